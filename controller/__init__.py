"""The single controller: config, CLI, schedules, admission, pools and metrics. Moves metadata only."""
