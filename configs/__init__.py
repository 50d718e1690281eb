"""The built-in configs, selectable by name (``--config=tiny:e3``); installed as ``jaxrl.configs``."""
