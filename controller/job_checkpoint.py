"""Job checkpoints: everything needed to continue a run as if it had not stopped, written atomically.

A job checkpoint is one directory ``RUN_DIR/checkpoints/step_N`` (N = trainer steps done)::

    .metadata, __*.distcp   the trainer's DCP checkpoint (trainers/checkpoint.py): model, optimizer, LR
                            scheduler, KL controller, RNG states, weight_version
    samples/                the whole uid groups generated but not trained yet, tensors and tags (weight
                            versions included): trainers/sample_store.py, moved by trainer rank 0. Every
                            field the run's rollers put (``controller.layout.sample_fields``: the dump's
                            ``response_text`` too), so every reader finds after a resume what it would before
    job.json                the controller's part (``JobState``): step, the group ledger's state (weight versions,
                            admission and group counters), the feeder's data position, the uids buffered and
                            in flight, the run's config

Written every ``trainer.save_every`` steps, when a stop signal ends the schedule, and at the end (none of
them with ``save_every=0``). Atomic: everything goes into ``checkpoints/.tmp_step_N``, every file and the
directory are fsynced, then it is renamed to ``step_N`` — a process killed in the middle of a save leaves
the previous checkpoints whole (a leftover ``.tmp_*`` is removed by the next save). ``trainer.keep_checkpoints``
bounds how many ``step_N`` are kept (0 = all). The snapshot is consistent: it is taken under
``Stages.feeder_lock``, which every stage that puts prompts (admit, refill, re-issue) holds, so the feeder's
position, the TransferQueue's contents and the group ledger describe the same moment.

Resume (``restore``): the trainer loads its part; the buffered samples are put back with their own weight
versions (into the sample partition: rollers take only prompt rows); the feeder continues the stream from
its position; the group ledger takes its counters back (``GroupLedger.restore``; a job.json written before
the ledger, format 1, is read too, any other format refused naming it); every roller gets the trainer's
weights; the groups in flight are re-issued (fresh ``.r<k>`` uids, the same prompts) under the restored
admission counters. So every prompt is trained exactly once per
epoch across stops and resumes, and the staleness bound holds: the counters are those of the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from common import schema
from controller.layout import PARTITION, PROMPT_PARTITION, optional_sample_fields, sample_fields
from controller.ledger import FORMAT, ledger_state

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
JOB_FILE = "job.json"
SAMPLES_DIR = "samples"
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp_"
# Test hook, "STEP:SECONDS": the save of step STEP pauses SECONDS after writing everything and before the
# rename, so a test's kill lands in the middle of a save. Unset in real runs.
PAUSE_ENV = "HFLOW_TEST_CHECKPOINT_PAUSE"
# Test hook, "STEP:SECONDS": the save of step STEP waits SECONDS before it looks at the TransferQueue (the
# feeder lock held: nothing is admitted meanwhile, the rollers finish the groups admitted already), so a
# test's checkpoint certainly holds the groups generated ahead of training. Unset in real runs.
HOLD_ENV = "HFLOW_TEST_CHECKPOINT_HOLD"

# Config keys a resume may not change: each would break a promise of the run (the prompt stream and its
# uids, the samples per group, the saved trainer parts, the staleness accounting). Prefixes cover a section.
FIXED_KEYS = ("mode", "model", "data", "rollout.n", "rollout.seed", "algorithm.adv_estimator",
              "algorithm.max_staleness", "algorithm.require_batches", "algorithm.dynamic_sampling",
              "trainer.use_reference")
CHANGEABLE_UNDER_FIXED = ("data.epochs",)  # more epochs only lengthen the stream
# The keys that choose the held-out prompts (controller.data.load_split). Not in CHANGEABLE_UNDER_FIXED: whether
# they change the training stream depends on the task. A procedural task trains on its first data.size rows
# whatever they are (the held-out ones are drawn after them), so there they change validation only; a file
# task (or a plug-in of fixed rows, split like a file) gives its held-out rows up from training, so there a
# change would change the prompt stream. So a change of these alone is allowed when both configs load the
# same training rows (``_same_training_rows``), and refused otherwise.
SPLIT_KEYS = ("data.val_size", "data.val_file", "data.val_disjoint")
# Keys added after job checkpoints were written, whose default does not do what the runs before them did: a
# saved config without one reads this value; any other key it lacks reads its default (config.with_defaults).
VALUES_BEFORE_THE_KEY = {
    "data.val_disjoint": False,  # before a48c431 held-out prompts were held out by row: what false does now
}


@dataclasses.dataclass
class JobState:
    """The controller's part of a job checkpoint (``job.json``, format ``controller.ledger.FORMAT``): ``step``
    and ``weight_version`` (equal: one update per step; here for people and for the checks of a resume),
    ``ledger``: ``GroupLedger.to_state()`` (admission counters, versions, group counters, refill rounds);
    ``feeder``: ``PromptFeeder.state()``; ``buffered_uids``: groups generated and not trained (their samples
    are in ``samples/``); ``in_flight_uids``: groups admitted and not generated yet (re-issued on resume);
    ``config``: the run's config as a dict (``controller.config.to_dict``)."""

    step: int
    weight_version: int
    ledger: dict[str, Any]
    feeder: dict[str, Any]
    buffered_uids: list[str]
    in_flight_uids: list[str]
    reason: str
    saved_at: float
    num_sample_bytes: int
    config: dict[str, Any]
    format: int = FORMAT

    @classmethod
    def read(cls, path: Path) -> JobState:
        """Read ``path/job.json``: this format, or format 1 (the flat job.json written before the group
        ledger, whose counters become the ledger's state). ValueError naming the file when it is not a job
        checkpoint's, or naming its format when this version does not read it."""
        try:
            data = json.loads((path / JOB_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path / JOB_FILE} is not a readable job checkpoint: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path / JOB_FILE} is not a readable job checkpoint: not a JSON object")
        try:
            ledger = ledger_state(data)
        except ValueError as exc:
            raise ValueError(f"{path / JOB_FILE}: {exc}") from exc
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path / JOB_FILE} is not a readable job checkpoint: {exc!r} missing") from exc
        fields = {f.name for f in dataclasses.fields(cls)} - {"ledger", "format"}
        try:
            return cls(**{k: data[k] for k in fields}, ledger=ledger)
        except KeyError as exc:
            raise ValueError(f"{path / JOB_FILE} is not a readable job checkpoint: {exc} missing") from exc


# ------------------------------------------------------------------------------------------ finding them


def list_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """Complete job checkpoints of ``run_dir``: step -> directory (a trainer-only checkpoint, without
    ``job.json``, is not one)."""
    root = Path(run_dir) / CHECKPOINTS
    return {int(m.group(1)): p for p in root.glob("step_*")
            if (m := STEP_DIR.fullmatch(p.name)) and (p / JOB_FILE).is_file()}


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The job checkpoint of ``run_dir`` at ``step`` (None: the latest). Raises ValueError naming the
    steps there are (or that there is none, and how they are made)."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"{run_dir} has no job checkpoint to resume from (checkpoints/step_N with {JOB_FILE}, "
                         "written every trainer.save_every steps, on a stop signal and at the end)")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ValueError(f"--resume-step {step}: {run_dir} has job checkpoints of steps {sorted(found)}")
    return found[step]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """The config a job checkpoint saved (a ``to_dict`` tree) as the run had it, in today's keys: a key added
    since the save reads ``VALUES_BEFORE_THE_KEY``'s value, or else its default (``config.with_defaults``)."""
    from controller.config import with_defaults

    tree = json.loads(json.dumps(saved))  # a copy, tuples as lists
    for key, value in VALUES_BEFORE_THE_KEY.items():
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and name not in node:
            node[name] = value
    return with_defaults(tree)


def _same_training_rows(saved_data: dict[str, Any], current_data: dict[str, Any]) -> bool:
    """Whether the two ``data`` sections (``to_dict`` trees) load the same training rows (``load_split``),
    in order: then the feeder's stream is the same. Raises load_split's ValueError for either."""
    from controller.config import DataConfig
    from controller.data import load_split

    def rows(tree: dict[str, Any]) -> list[tuple[str, Any]]:
        cfg = DataConfig(**{f.name: tree[f.name] for f in dataclasses.fields(DataConfig)})
        return [(r.prompt, r.ground_truth) for r in load_split(cfg).train]

    return rows(saved_data) == rows(current_data)


def check_resume_config(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Compare the run's saved config (read through ``saved_config``: keys added since the save take the
    value the run had) with the one a resume would use (both ``to_dict`` trees). Returns the changed keys
    that are allowed (steps, logging, pool sizes...); raises ValueError naming every changed key of
    ``FIXED_KEYS`` with both values (``SPLIT_KEYS`` only where the training rows change with them)."""
    saved, current = saved_config(saved), json.loads(json.dumps(current))
    old, new = _flatten(saved), _flatten(current)
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "run_dir")
    refused = [k for k in changed if k not in CHANGEABLE_UNDER_FIXED
               and any(k == f or k.startswith(f + ".") for f in FIXED_KEYS)]
    if refused and set(refused) <= set(SPLIT_KEYS) and _same_training_rows(saved["data"], current["data"]):
        refused = []  # they choose other held-out prompts only
    if refused:
        what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in refused)
        split = ("; here the held-out prompts are taken out of the training rows, so the training prompts would "
                 "change too" if set(refused) <= set(SPLIT_KEYS) else "")
        raise ValueError(f"cannot resume with a changed {', '.join(refused)} ({what}): it would break the run's "
                         f"promises (each prompt trained once per epoch, the staleness bound){split}; keep the "
                         "run's values or start a new run")
    return changed


def truncate_metrics(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """Keep the rows of ``RUN_DIR/metrics.jsonl`` up to ``step`` (those after it belong to a stretch the
    resume trains again; they move to ``metrics.superseded.jsonl``); returns the kept rows. Atomic."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    kept, dropped = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        (kept if int(row.get("step", 0)) <= step else dropped).append(row)
    if dropped:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in dropped)
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def check_saved_samples(cfg, path: Path, state: JobState) -> None:
    """Raise ValueError when the buffered samples of the checkpoint at ``path`` lack a field the rollers of
    ``cfg`` put (``controller.layout.sample_fields``), saying what to do: a setting that turns the field on
    changed since the save (e.g. ``metrics.dump_every`` from 0 to 1, whose dump reads ``response_text``):
    resume with the run's own value of that key; the run's rollers put it but the checkpoint predates saving
    it: resume with that setting turned off."""
    from trainers.sample_store import INDEX_FILE

    if not state.buffered_uids:
        return
    saved = json.loads((path / SAMPLES_DIR / INDEX_FILE).read_text())["fields"]
    missing = [name for name in sample_fields(cfg) if name not in saved]
    if not missing:
        return
    run = saved_config(state.config)  # what the run's own rollers put
    run_put = optional_sample_fields(run["algorithm"]["adv_estimator"], run["metrics"]["dump_every"])
    turned_on = optional_sample_fields(cfg.algorithm.adv_estimator, cfg.metrics.dump_every)
    added = sorted({turned_on[n] for n in missing if n not in run_put})  # turned on since the save
    predates = sorted({turned_on[n] for n in missing if n in run_put})  # put, but not saved before d396240
    flat = _flatten(run)
    why = [f"{', '.join(added)} changed since the save and turns on fields the run did not put: resume with the "
           "run's own " + ", ".join(f"{k}={flat[k]}" for k in added)] if added else []
    if predates:
        off = ", ".join("metrics.dump_every=0" if k == "metrics.dump_every" else k for k in predates)
        why.append(f"the checkpoint predates saving every field the rollers put: resume with the settings that "
                   f"put them turned off, here {off}")
    raise ValueError(f"{path}: its {len(state.buffered_uids)} buffered groups were saved without {missing}, "
                     f"which this config's rollers put and its readers need ({'; '.join(why)}), or resume from a "
                     "checkpoint with no groups buffered")


def prepare_resume(cfg, step: int | None, model_dir: Path):
    """(checkpoint directory, JobState, rows of metrics.jsonl kept) to resume ``cfg.run_dir`` from, or None
    when nothing is left to train (a line says why: ``trainer.total_steps`` reached, or the data exhausted
    with nothing buffered or in flight). Raises ValueError when there is no such checkpoint, the config
    changed a key it may not, or ``model_dir`` (a completed run's model) exists while steps remain."""
    from controller.config import to_dict

    run_dir = Path(cfg.run_dir)
    path = find_checkpoint(run_dir, step)
    state = JobState.read(path)
    changed = check_resume_config(state.config, to_dict(cfg))
    if changed:
        print(f"hflow-async: resuming with changed {', '.join(changed)}", flush=True)
    if state.step >= cfg.trainer.total_steps:
        print(f"hflow-async: {path} is at step {state.step} of trainer.total_steps={cfg.trainer.total_steps}: "
              "nothing left to train", flush=True)
        return None
    if state.feeder["exhausted"] and not state.buffered_uids and not state.in_flight_uids:
        print(f"hflow-async: data exhausted at step {state.step} ({path}: every prompt of data.epochs="
              f"{cfg.data.epochs} is trained, none buffered): nothing left to train", flush=True)
        return None
    check_saved_samples(cfg, path, state)
    if model_dir.exists():
        raise ValueError(f"{model_dir} holds the model of a completed run; move it away to resume from step "
                         f"{state.step}")
    print(f"hflow-async: resuming {run_dir} from {path} (step {state.step}, weight_version {state.weight_version})",
          flush=True)
    return path, state, truncate_metrics(run_dir, state.step)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every directory, ``root`` included."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ save / restore


class JobCheckpointer:
    """Saves and restores the job checkpoints of one run (``cfg``: the run's ``HFlowConfig``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.root = Path(cfg.run_dir) / CHECKPOINTS
        self.last_saved_step: int | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.trainer.save_every > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.trainer.save_every == 0

    def sample_fields(self) -> list[str]:
        """The stored fields a buffered sample is saved and put back with (``common.schema.CHECKPOINT``):
        every field this run's rollers put (``controller.layout.sample_fields``), so whatever reads a sample
        after a resume (the trainer, the generation dump) finds it."""
        return list(sample_fields(self.cfg))

    async def save(self, st, reason: str) -> Path | None:
        """Write a job checkpoint of ``st`` (``controller.stages.Stages``) at its step, holding the
        feeder lock so nothing is admitted meanwhile; its path, or None when checkpoints are off or this step
        is saved already."""
        if not self.enabled or self.last_saved_step == st.ledger.step:
            return None
        async with st.feeder_lock:
            return await asyncio.to_thread(self.save_now, st, reason)

    def save_now(self, st, reason: str) -> Path | None:
        """:meth:`save` without the lock, blocking: for a stop, once every stage has unwound."""
        if not self.enabled or self.last_saved_step == st.ledger.step:
            return None
        import ray

        from controller.config import to_dict

        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = self.root / f"{TMP_PREFIX}step_{st.ledger.step}"
        st.rt.trainer.save_checkpoint(str(tmp))
        self._test_pause(HOLD_ENV, st.ledger.step, "holding {}s before its snapshot")
        buffered, in_flight, num_bytes = self.save_samples(st, tmp / SAMPLES_DIR)
        feeder = ray.get(st.rt.feeder.state.remote())
        state = JobState(
            step=st.ledger.step, weight_version=st.ledger.weight_version, ledger=st.ledger.to_state(),
            feeder=feeder, buffered_uids=sorted({t[schema.UID] for t in buffered.tags}), in_flight_uids=in_flight,
            reason=reason, saved_at=time.time(), num_sample_bytes=num_bytes, config=to_dict(self.cfg))
        (tmp / JOB_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1) + "\n")
        self._test_pause(PAUSE_ENV, st.ledger.step, "written, pausing {}s before the rename")
        _fsync_tree(tmp)
        final = self.root / f"step_{st.ledger.step}"
        if final.exists():  # a step trained again after a resume from an earlier checkpoint
            old = self.root / f"{TMP_PREFIX}old_step_{st.ledger.step}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        self.last_saved_step = st.ledger.step
        self._prune()
        print(f"hflow-async: job checkpoint {final} ({reason}; {len(state.buffered_uids)} groups buffered, "
              f"{len(in_flight)} in flight) in {time.monotonic() - started:.1f}s", flush=True)
        return final

    @staticmethod
    def _test_pause(env: str, step: int, what: str) -> None:
        """The test hooks ``PAUSE_ENV`` and ``HOLD_ENV``: sleep when ``env`` names ``step`` (saying ``what``)."""
        pause_step, _, pause_s = os.environ.get(env, "").partition(":")
        if pause_step and int(pause_step) == step:
            print(f"hflow-async: checkpoint of step {step} {what.format(pause_s)}", flush=True)
            time.sleep(float(pause_s))

    def save_samples(self, st, directory: Path):
        """Write the whole generated groups of ``st``'s TransferQueue under ``directory`` (through trainer rank
        0: ``trainers.sample_store``), each sample with every field of :meth:`sample_fields` and its tags.
        Returns (their BatchMeta, uids of the groups in flight, bytes of tensors written). Blocking."""
        from trainers.sample_store import save_samples

        buffered, in_flight = self._snapshot(st)
        fields = self.sample_fields() if buffered.sample_ids else []
        num_bytes = st.rt.trainer.execute(save_samples, buffered.to_wire(), fields, str(directory))[0]
        return buffered, in_flight, num_bytes

    def restore_samples(self, st, directory: Path) -> list[str]:
        """Put the samples :meth:`save_samples` wrote under ``directory`` back into the sample partition with
        the fields of :meth:`sample_fields`; their uids, in order. Raises ValueError naming a field the saved
        samples lack. Blocking."""
        from trainers.sample_store import restore_samples

        return st.rt.trainer.execute(restore_samples, str(directory), PARTITION, self.sample_fields())[0]

    def _snapshot(self, st):
        """(BatchMeta of the whole generated groups in the TransferQueue, uids of the groups in flight: a
        prompt row not yet turned into samples, or an incomplete group). Metadata only
        (``TQClient.sample_info``). The prompt rows are read first: a roller puts a group's samples before it
        clears the prompt row, so a group finishing meanwhile is seen in one of the two (or both: buffered)."""
        from transferqueue.records import BatchMeta

        prompts = {str(info["tags"][schema.UID]) for info in self._infos(st, PROMPT_PARTITION)}
        infos = self._infos(st, PARTITION)
        by_uid: dict[str, list[dict]] = {}
        for info in infos:
            by_uid.setdefault(str(info["tags"][schema.UID]), []).append(info)
        need = set(self.sample_fields())
        ids, tags, in_flight = [], [], []
        for uid, samples in by_uid.items():
            if len(samples) == st.n and all(need <= set(s["fields"]) for s in samples):
                ids += [s["id"] for s in samples]
                tags += [s["tags"] for s in samples]
            else:
                in_flight.append(uid)
        buffered = {str(t[schema.UID]) for t in tags}
        return BatchMeta(PARTITION, ids, [], tags), sorted(set(in_flight) | (prompts - buffered))

    def _infos(self, st, partition: str) -> list[dict]:
        """``sample_info`` of every row of ``partition`` ([] while nothing was ever put there); RuntimeError
        when it holds ``transferqueue.max_request_ids`` rows or more."""
        from transferqueue.records import RemoteError

        limit = self.cfg.transferqueue.max_request_ids
        try:
            infos = st.rt.tq.sample_info(partition, limit=limit)
        except RemoteError as exc:
            if "unknown partition" not in str(exc):
                raise
            return []
        if len(infos) >= limit:
            raise RuntimeError(f"the TransferQueue holds {limit} or more rows in {partition!r} "
                               "(transferqueue.max_request_ids): too many to checkpoint in one request")
        return infos

    def _prune(self) -> None:
        keep = self.cfg.trainer.keep_checkpoints
        if keep <= 0:
            return
        found = list_checkpoints(self.cfg.run_dir)
        for step in sorted(found)[:-keep]:
            shutil.rmtree(found[step], ignore_errors=True)

    async def restore(self, st, path: Path) -> JobState:
        """Bring ``st`` (fresh pools) to the checkpoint at ``path``: trainer state, buffered samples, the
        feeder's position, the counters; sync the rollers to the restored weights; re-issue the groups in
        flight. Raises ValueError when the trainer's restored ``weight_version`` disagrees with ``job.json``."""
        started = time.monotonic()
        state = JobState.read(path)
        await asyncio.to_thread(st.rt.trainer.load_checkpoint, str(path))
        trainer_weight_version = await asyncio.to_thread(st.rt.trainer.get_weight_version)
        if trainer_weight_version != state.weight_version:
            raise ValueError(f"{path}: the trainer checkpoint has weight_version {trainer_weight_version}, "
                             f"{JOB_FILE} says {state.weight_version}")
        uids = await asyncio.to_thread(self.restore_samples, st, path / SAMPLES_DIR)
        await st.rt.feeder.restore.remote(state.feeder)
        rounds = st.ledger.restore(state.ledger)
        st.ledger.adopt(list(dict.fromkeys(uids)))
        await st.sync_weights()  # the rollers started with the initial weights
        if state.in_flight_uids:
            fed = await st.rt.feeder.reissue.remote(state.in_flight_uids)
            st.ledger.adopt([g["uid"] for g in fed])
            for old, new in zip(state.in_flight_uids, fed, strict=True):  # a re-issue keeps its refill round
                if old in rounds:
                    rounds[new["uid"]] = rounds.pop(old)
        st.ledger.adopt_rounds(rounds)
        self.last_saved_step = state.step
        logger.info("resumed from %s in %.1fs: step %d, weight_version %d, %d groups buffered, %d re-issued", path,
                    time.monotonic() - started, state.step, state.weight_version, len(set(uids)),
                    len(state.in_flight_uids))
        return state
