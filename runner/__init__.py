"""The task runner: runs task sets through agent harnesses in sandboxes against the gateway, verifies, rewards."""
