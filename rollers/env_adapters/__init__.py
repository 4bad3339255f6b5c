"""Adapters that run environments of public libraries in the agent loop (``rollers.agent_loop``).

Each adapter is one module, registered by name in ``rollers.environments`` with a factory that imports it only
when that environment is chosen, so its library stays an optional extra: ``gem`` (``rollers.env_adapters.gem``,
``pip install 'hflow-async[gem]'``).
"""
