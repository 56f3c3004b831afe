"""What the protocols share: error body, serving shells, choices, stream blocks, route registration."""
