"""clawgate trainer: prefix trees, advantages and LoRA policy updates from captured calls."""
