"""A process record tells a live process from a dead one where that can be told (this host, boot
and PID namespace, a reused PID included) and says so where it cannot; a sealed folder is
unsealed by any change to its files."""
import json
import subprocess
import sys

from lookahead_core.engine.graphs.package_files import alive, running, seal, this_process, unsealed


def test_a_record_is_alive_only_while_its_process_runs_here():
    child = subprocess.run([sys.executable, "-c", "import json; from lookahead_core.engine.graphs.package_files "
                            "import this_process; print(json.dumps(this_process()))"], capture_output=True, text=True)
    me = this_process()
    assert alive(me) is True
    assert alive(json.loads(child.stdout)) is False  # ended
    assert alive({**me, "start": "0"}) is False  # this PID, another process's start: reused
    assert alive({**me, "boot": "another"}) is False  # this host restarted since
    assert alive({**me, "host": "elsewhere"}) is None and alive({**me, "pidns": "pid:[1]"}) is None
    assert alive(None) is None


def test_a_running_record_stays_only_while_its_body_runs(tmp_path):
    with running(tmp_path):
        (record,) = tmp_path.iterdir()
        assert json.loads(record.read_text()) == this_process()
    assert list(tmp_path.iterdir()) == []


def test_any_change_to_a_sealed_folder_unseals_it(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lib.so").write_bytes(b"x")
    seal(tmp_path)
    assert unsealed(tmp_path) is None
    with running(tmp_path):  # a record is not one of its files
        assert unsealed(tmp_path) is None
    (tmp_path / "a" / "lib.so").write_bytes(b"y")
    assert "does not match" in unsealed(tmp_path)
