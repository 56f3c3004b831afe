"""clawgate's top: the `clawgate` command assembled from its owners' subcommands, embedded mode, the tiny model."""
