"""This project's own tools (a package named ``tools``, like agentrl's: it loads beside it)."""
