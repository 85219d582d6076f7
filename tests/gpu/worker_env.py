"""Part 2's worker: write down the devices this process was given, then wait to be stopped.

``python -m tests.gpu.worker_env OUT_DIR [--cuda]`` writes
``OUT_DIR/<job id>-<pid>.json``: its ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` and, with ``--cuda``, what CUDA itself shows it (how many
devices, the first one's UUID and name), so the check can compare the device a
job sees with the one NVML's index names. Then it sleeps until the job is
cancelled (at most 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", "TIDAL_JOB_ID")


def cuda_view() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"device_count": 0}
    props = torch.cuda.get_device_properties(0)
    uuid = str(getattr(props, "uuid", "") or "")  # NVML writes it "GPU-<uuid>"
    return {"device_count": torch.cuda.device_count(), "uuid": uuid, "name": props.name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    seen: dict[str, Any] = {k: os.environ.get(k) for k in KEYS}
    if args.cuda:
        seen["cuda"] = cuda_view()
    path = args.out / f"{os.environ.get('TIDAL_JOB_ID', 'job')}-{os.getpid()}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(seen))
    os.replace(tmp, path)  # never read half-written
    time.sleep(600)


if __name__ == "__main__":
    main()
