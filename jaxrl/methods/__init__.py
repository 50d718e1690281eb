"""The four papers' methods: allocation, schedules and their controllers, their registry, and phases."""
