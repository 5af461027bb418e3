"""The RAM snapshot directory outlives every rank of the node that still runs, and no longer."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rl_guard.control.ram_dir import ram_dir, release

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rl_guard.control.ram_dir import ram_dir
    root, run, rank, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    path = ram_dir(run, rank, "actor", root=root)
    print("ready", flush=True)
    while not go.exists():  # rank 1 waits until rank 0 has saved and exited, then saves and reads the directory
        time.sleep(0.05)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"shard{rank}").write_text("x")
    print(sorted(p.name for p in path.iterdir()), flush=True)
""")


def test_an_early_exiting_rank_leaves_the_directory_to_the_others(tmp_path):
    root, go = tmp_path / "shm", tmp_path / "go"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(root), str(tmp_path / "run")]
    rank1 = subprocess.Popen(
        [sys.executable, "-c", RANK, *args, "1", str(go)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert rank1.stdout.readline().strip() == "ready"
    go_now = tmp_path / "go_now"
    go_now.touch()
    rank0 = subprocess.run(
        [sys.executable, "-c", RANK, *args, "0", str(go_now)], env=env, capture_output=True, text=True
    )
    assert rank0.returncode == 0, rank0.stderr  # rank 0 saved its shard and exited while rank 1 still runs
    go.touch()
    listed = rank1.stdout.readline().strip()
    assert rank1.wait(timeout=60) == 0
    assert listed == "['shard0', 'shard1']"  # rank 0's exit removed nothing rank 1 still used
    assert list((root / "rl_guard").iterdir()) == []  # the last one out freed the RAM


def test_markers_of_dead_processes_do_not_keep_the_directory(tmp_path):
    path = ram_dir(tmp_path / "run", 0, root=tmp_path)
    path.mkdir(parents=True)
    alive = path.parent / f"{path.name}.alive"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (alive / dead.stdout.strip()).touch()  # a rank that was killed before its exit handler ran
    assert release(path, alive)
    assert not path.exists() and not alive.exists()


def test_a_live_marker_keeps_the_directory(tmp_path):
    path = ram_dir(tmp_path / "run", 0, root=tmp_path)
    path.mkdir(parents=True)
    alive = path.parent / f"{path.name}.alive"
    (alive / str(os.getppid())).touch()  # another process of the run, still running
    assert not release(path, alive)
    assert path.is_dir()


def test_rank_zero_clears_an_earlier_run_and_disk_mode_has_no_ram_dir(tmp_path):
    first = ram_dir(tmp_path / "run", 0, "actor", root=tmp_path)
    first.mkdir(parents=True)
    (first / "stale").write_text("x")
    assert ram_dir(tmp_path / "run", 1, "actor", root=tmp_path) == first and (first / "stale").exists()
    assert ram_dir(tmp_path / "run", 0, "actor", root=tmp_path) == first and not first.exists()
    assert ram_dir(tmp_path / "run", 0, where="disk", root=tmp_path) is None
    assert ram_dir(tmp_path / "run", 0, root=tmp_path / "no_shm") is None
