"""Where the ranks run: hostfiles, presets, what a command targets, per-host storage, remote helpers, doctor."""
