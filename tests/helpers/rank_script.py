"""gradnorm/train.py as one rank of a launch that goes wrong on purpose: ``torchrun ... tests/helpers/
rank_script.py FLAGS`` runs the trainer's script with FLAGS, after what these variables ask of this rank:

    GRADNORM_TEST_CWD_<RANK>=DIR   start in DIR (relative flags name other files there: another node)
    GRADNORM_TEST_KILL_WHEN=PATH   on torchrun's first attempt, rank 1 SIGKILLs itself once PATH holds bytes
    GRADNORM_TEST_LATE_<RANK>=S    this rank starts S seconds late: on every attempt, or with
    GRADNORM_TEST_LATE_ON=restart  only on a restart (TORCHELASTIC_RESTART_COUNT > 0)
    GRADNORM_TEST_LOG=PATH         each rank appends "attempt A rank R" there as it starts the trainer

A script, not a module of the package: torchrun runs it by path, as it runs gradnorm/train.py.
"""

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "gradnorm" / "train.py"


def _kill_when(path: Path) -> None:
    while not (path.exists() and path.stat().st_size > 0):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    rank, attempt = os.environ["RANK"], int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if f"GRADNORM_TEST_CWD_{rank}" in os.environ:
        os.chdir(os.environ[f"GRADNORM_TEST_CWD_{rank}"])
    if rank == "1" and attempt == 0 and "GRADNORM_TEST_KILL_WHEN" in os.environ:
        threading.Thread(target=_kill_when, args=(Path(os.environ["GRADNORM_TEST_KILL_WHEN"]),), daemon=True).start()
    if attempt > 0 or os.environ.get("GRADNORM_TEST_LATE_ON") != "restart":
        time.sleep(float(os.environ.get(f"GRADNORM_TEST_LATE_{rank}", "0")))
    if "GRADNORM_TEST_LOG" in os.environ:
        with open(os.environ["GRADNORM_TEST_LOG"], "a") as log:
            log.write(f"attempt {attempt} rank {rank}\n")
    sys.argv = [str(TRAIN), *sys.argv[1:]]
    runpy.run_path(str(TRAIN), run_name="__main__")
