"""glm46 entry point: compose the Hydra config, validate it, run its `task`. Nothing else lives here."""

import hydra
from omegaconf import DictConfig

from glm46.app.schema import register_configs
from glm46.app.tasks import run_task

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_task(cfg)


if __name__ == "__main__":
    main()
