"""The ``ditrun`` command: compose the Hydra config and hand it to the launcher.

``ditrun report PATH`` is dispatched before Hydra sees the arguments: it compares finished runs
and composes no config. ``ditrun tune key=value ...`` likewise: it composes the config itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ditrun.config import RunConfig, register_configs
from ditrun.errors import UserError

register_configs()

# Runs of a multirun that failed the SSIM gate: the sweep goes on, and the command exits 1 at its end.
_gate_failures: list[str] = []


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: RunConfig) -> None:
    from ditrun.launch import WorkerFailed, launch
    from ditrun.metrics.quality import QualityGateError
    from ditrun.metrics.wandb import apply_sweep_defaults

    hydra_cfg = HydraConfig.get()
    out_dir = Path(cfg.output_dir) if cfg.output_dir else Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        apply_sweep_defaults(cfg, hydra_cfg.sweep.dir, hydra_cfg.job.num)
    try:
        launch(cfg, out_dir)
    except QualityGateError as err:
        print(f"ditrun: error: {err}", file=sys.stderr, flush=True)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(1)
        _gate_failures.append(f"{out_dir}: {err}")
    except WorkerFailed as err:
        # The failed rank printed its own traceback; this names it once more, last.
        print(f"ditrun: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except UserError as err:
        # A user's mistake is one sentence; DITRUN_DEBUG=1 shows the traceback behind it anyway.
        if os.environ.get("DITRUN_DEBUG"):
            raise
        print(f"ditrun: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, UserError)


def main() -> None:
    if sys.argv[1:2] == ["report"]:
        from ditrun.metrics.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if sys.argv[1:2] == ["tune"]:
        from ditrun.kernels.tune import main as tune_main

        sys.exit(tune_main(sys.argv[2:]))
    _hydra_main()
    if _gate_failures:
        print(f"ditrun: error: {len(_gate_failures)} run(s) of the sweep failed the SSIM gate:", file=sys.stderr)
        for failure in _gate_failures:
            print(f"  {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
