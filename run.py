"""glm46 entry point: compose the Hydra config, validate it, run its `task`. Nothing else lives here."""

import sys

import hydra
from omegaconf import DictConfig

from glm46.app.tasks import run_task
from glm46.config.aliases import renamed_overrides
from glm46.config.checks import Refused
from glm46.config.restore import restored_overrides
from glm46.config.schema import register_configs
from glm46.errors import ConfigError

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> object:
    try:
        return run_task(cfg)  # the job's return value: glm46.app.sweep.RunState reads an interruption from it
    except ConfigError as error:  # a composition that cannot run: its message names the keys
        raise Refused(str(error)) from None


if __name__ == "__main__":
    sys.argv[1:] = renamed_overrides(restored_overrides(sys.argv[1:]))
    main()
