"""The ``ditrun`` command: compose the Hydra config and hand it to the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from ditrun.config import RunConfig, register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: RunConfig) -> None:
    from ditrun.launch import launch

    out_dir = Path(cfg.output_dir) if cfg.output_dir else Path(HydraConfig.get().runtime.output_dir)
    try:
        launch(cfg, out_dir)
    except (ValueError, RuntimeError) as err:
        if not _is_user_error(err):
            raise
        print(f"ditrun: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _is_user_error(err: Exception) -> bool:
    from ditrun.model.load import CheckpointError
    from ditrun.workload import WorkloadError

    return isinstance(err, (CheckpointError, WorkloadError)) or type(err) is ValueError


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
