"""Where the scheduler's grammar costs come from: one executor per mode (``base`` holds the interface)."""
