"""Which of gradnorm's files one optimizer step of the trainer enters, traced, not read.

    python benchmarks/step_path.py             # this checkout
    python benchmarks/step_path.py OTHER_ROOT  # another checkout (e.g. a git worktree of an older commit)

One process, the built-in model, 3 steps; the profile hook records every call into a file under
gradnorm/ during step 2 (from its rollout to the next one). Printed: the distinct files entered,
the changes of file along the call sequence and how many of those go back to a file already left,
and the calls gradnorm/train.py makes itself (how deep the step's ideas sit): each call site, its
line of source and how often it ran, so the count all-reduce, each microbatch's weights (the line
that multiplies them by W follows) and its backward show as calls made from train.py.
"""

import linecache
import os
import sys
from collections import Counter
import tempfile
from pathlib import Path


def main(root: Path) -> None:
    sys.path.insert(0, str(root))
    import torch

    torch.set_num_threads(1)
    from gradnorm import train

    pkg, loop_file = str(root / "gradnorm"), str(root / "gradnorm" / "train.py")
    rollouts, recording, path, from_loop, sites = [0], [False], [], [], Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        where = frame.f_code.co_filename
        caller = frame.f_back
        if recording[0] and caller is not None and caller.f_code.co_filename == loop_file and where != loop_file \
                and (where.startswith(pkg) or frame.f_code.co_name == "backward"):  # torch's backward, too
            sites[(caller.f_lineno, frame.f_code.co_name)] += 1
        if not where.startswith(pkg):
            return
        if frame.f_code.co_name == "generate_rollout":
            rollouts[0] += 1
            recording[0] = rollouts[0] == 2
        if not recording[0]:
            return
        rel = os.path.relpath(where, root)
        if not path or path[-1] != rel:
            path.append(rel)
        if frame.f_back is not None and frame.f_back.f_code.co_filename == loop_file and where != loop_file:
            from_loop.append(rel)

    out = tempfile.mkdtemp()
    sys.setprofile(profile)
    try:
        train.main(["--steps", "3", "--warmup-steps", "2", "--eval-prompts", "2", "--output-dir", f"{out}/run",
                    "--no-plot", "--save-every", "0"])
    finally:
        sys.setprofile(None)
    left, returns = set(), 0
    for a, b in zip(path, path[1:]):
        left.add(a)
        returns += b in left
    print(f"step 2 entered {len(set(path))} files, changed file {len(path) - 1} times, {returns} of them back to "
          "a file already left")
    print(f"the loop made {len(from_loop)} calls into {len(set(from_loop))} files: {', '.join(sorted(set(from_loop)))}")
    for name in sorted(set(path)):
        print("  " + name)
    print("the calls gradnorm/train.py made during step 2 (line: function x times | the line):")
    calls = {(line, function): times for (line, function), times in sites.items()  # not a property's read
             if f"{function}(" in linecache.getline(loop_file, line) or function == "backward"}
    for (line, function), times in sorted(calls.items()):
        print(f"  {line:4d}: {function} x{times} | {linecache.getline(loop_file, line).strip()}")
    weights = [line for line, function in calls if function == "token_weights"]
    backward = [line for line, function in calls if function == "backward"]
    if weights and backward:
        print("a microbatch's weights, times W, to its backward, as gradnorm/train.py writes them:")
        for line in range(min(weights), max(backward) + 1):
            print(f"  {line:4d}  {linecache.getline(loop_file, line).rstrip()}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve())
