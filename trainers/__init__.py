"""FSDP2 trainer workers and the RL algorithm library."""
