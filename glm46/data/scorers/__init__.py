"""The models that filters of the preparation score documents with (glm46.data.staged runs them)."""
