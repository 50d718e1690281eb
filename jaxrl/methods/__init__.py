"""The four papers' policies: allocation, schedules and controllers, their registry, and phases."""
