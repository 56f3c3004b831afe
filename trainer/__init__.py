"""clawgate trainer: advantages and LoRA policy updates from the prefix trees of captured calls."""
