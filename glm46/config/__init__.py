"""The config system: the schemas of the config groups (`schema/`, Hydra refuses a wrong key or type while
composing), the resolvers, renamed command-line names, and the checks of what a type cannot say (`checks.py`)."""
