"""An importable ``deep_ep`` for processes ep_comm did not start (ep_comm/integrations/deep_ep.py,
deep_ep_startup.py): ``importlib.util.find_spec("deep_ep")`` and ``import deep_ep`` in a fresh
``python -c``, in a script and in its ``multiprocessing`` spawn worker, switched by
``EP_COMM_PROVIDE_DEEP_EP`` through the ``.pth`` file that ``enable`` writes; spawn workers of a
process that called ``install()``; and an installed DeepEP, which wins unless ``override`` is asked
for, and is then named in a warning.

The fresh processes see a temporary site directory holding the ``.pth`` file, added at startup by a
``sitecustomize`` on ``PYTHONPATH`` (``site.addsitedir`` handles ``.pth`` files exactly as for
site-packages), so the tests never write into the environment's own site-packages.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from ep_comm.integrations import deep_ep as shim
from ep_comm.integrations import deep_ep_startup

_PROBE = textwrap.dedent("""
    import importlib.util, json, multiprocessing, sys

    def probe():
        spec = importlib.util.find_spec("deep_ep")
        result = {"origin": spec.origin if spec is not None else None}
        if spec is not None:
            import deep_ep, deep_ep_cpp, ep_comm
            from deep_ep.utils.envs import init_dist
            from deep_ep.utils.math import calc_diff, per_token_cast_to_fp8
            from deep_ep.utils.testing import bench, bench_kineto
            result.update(buffer=deep_ep.Buffer is ep_comm.Buffer, version=deep_ep.__version__,
                          cpp=deep_ep_cpp.Config is ep_comm.Config, real=getattr(deep_ep, "REAL", False))
        return result

    def child(queue):
        queue.put(probe())

    if __name__ == "__main__":
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        worker = context.Process(target=child, args=(queue,))
        worker.start()
        spawned = queue.get(timeout=240)
        worker.join()
        print(json.dumps({"parent": probe(), "spawned": spawned}))
""")


@pytest.fixture
def site_env(tmp_path):
    """An environment for fresh interpreters whose startup processes a temporary site directory
    holding the file ``enable`` writes; returns ``(env, tmp_path)``."""
    site_dir, custom = tmp_path / "site", tmp_path / "custom"
    site_dir.mkdir()
    custom.mkdir()
    written = shim.enable(str(site_dir))
    assert open(written).read() == deep_ep_startup.PTH_LINE + "\n"
    (custom / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in (deep_ep_startup.ENV_VAR, "PYTHONPATH")}
    env["PYTHONPATH"] = str(custom)
    return env, tmp_path


def _run(args, env, timeout=300):
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _origin_in_fresh_python(env):
    code = "import importlib.util; s = importlib.util.find_spec('deep_ep'); print(s.origin if s else None)"
    return _run(["-c", code], env).stdout.strip()


def _under_path_entry(origin):
    return origin is not None and origin.startswith(shim.PATH_ENTRY + os.sep)


def test_switch_provides_deep_ep_to_fresh_and_spawned_processes(site_env):
    env, tmp_path = site_env
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)

    assert _origin_in_fresh_python(env) == "None"
    off = json.loads(_run([str(script)], env).stdout)
    assert off == {"parent": {"origin": None}, "spawned": {"origin": None}}

    env[deep_ep_startup.ENV_VAR] = "1"
    assert _under_path_entry(_origin_in_fresh_python(env))
    on = json.loads(_run([str(script)], env).stdout)
    for side in ("parent", "spawned"):
        result = on[side]
        assert _under_path_entry(result["origin"]), result
        assert result["buffer"] and result["cpp"] and not result["real"]
        assert result["version"] == shim.DEEP_EP_VERSION


def _fake_deep_ep(tmp_path):
    real = tmp_path / "installed"
    (real / "deep_ep").mkdir(parents=True)
    (real / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    return real


def test_installed_deep_ep_wins_unless_override(site_env):
    env, tmp_path = site_env
    real = _fake_deep_ep(tmp_path)
    env["PYTHONPATH"] += os.pathsep + str(real)
    code = "import deep_ep; print(getattr(deep_ep, 'REAL', False), deep_ep.__file__)"

    env[deep_ep_startup.ENV_VAR] = "1"
    fallback = _run(["-c", code], env)
    assert fallback.stdout.split()[0] == "True" and "ShadowedDeepEPWarning" not in fallback.stderr

    env[deep_ep_startup.ENV_VAR] = "override"
    override = _run(["-c", code], env)
    is_real, origin = override.stdout.split()
    assert is_real == "False" and _under_path_entry(origin)
    assert "ShadowedDeepEPWarning" in override.stderr
    assert str(real / "deep_ep" / "__init__.py") in override.stderr


def test_install_names_the_deep_ep_it_hides(tmp_path, monkeypatch):
    real = _fake_deep_ep(tmp_path)
    monkeypatch.syspath_prepend(str(real))
    assert shim.installed_deep_ep() == str(real / "deep_ep" / "__init__.py")
    try:
        with pytest.warns(shim.ShadowedDeepEPWarning, match="installed at .*installed"):
            module = shim.install()
        assert shim.is_provided(module) and not hasattr(module, "REAL")
    finally:
        shim.uninstall()
    assert "deep_ep" not in sys.modules


def _spawned_probe(queue):
    import importlib.util

    spec = importlib.util.find_spec("deep_ep")
    if spec is None:
        queue.put((None, False))
        return
    import deep_ep

    import ep_comm

    queue.put((spec.origin, deep_ep.Buffer is ep_comm.Buffer))


def test_install_reaches_spawn_workers_started_afterwards():
    import importlib.util

    shim.install()
    try:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        worker = context.Process(target=_spawned_probe, args=(queue,))
        worker.start()
        origin, same_buffer = queue.get(timeout=240)
        worker.join()
    finally:
        shim.uninstall()
    assert _under_path_entry(origin) and same_buffer
    assert shim.PATH_ENTRY not in sys.path and importlib.util.find_spec("deep_ep") is None


def test_activate_follows_the_variable():
    entry = deep_ep_startup.PATH_ENTRY
    for value in ("", "0", "off", "False"):
        path = ["a", "b"]
        assert deep_ep_startup.activate({deep_ep_startup.ENV_VAR: value}, path) is None and path == ["a", "b"]
    path = ["a", "b"]
    assert deep_ep_startup.activate({deep_ep_startup.ENV_VAR: "1"}, path) == "fallback"
    assert deep_ep_startup.activate({deep_ep_startup.ENV_VAR: " yes "}, path) == "fallback"
    assert path == ["a", "b", entry]
    assert deep_ep_startup.activate({deep_ep_startup.ENV_VAR: "override"}, path) == "override"
    assert path == [entry, "a", "b"]
    with pytest.warns(UserWarning, match="not one of"):
        assert deep_ep_startup.activate({deep_ep_startup.ENV_VAR: "maybe"}, ["a"]) is None


def test_command_line(tmp_path, capsys):
    assert shim.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == shim.PATH_ENTRY
    assert shim.main(["enable", "--site-dir", str(tmp_path)]) == 0
    assert (tmp_path / shim.PTH_NAME).read_text() == deep_ep_startup.PTH_LINE + "\n"
    assert shim.main(["disable", "--site-dir", str(tmp_path)]) == 0
    assert not (tmp_path / shim.PTH_NAME).exists()
    assert shim.disable(str(tmp_path)) is False
    capsys.readouterr()
    assert shim.main(["status"]) == 0
    assert "import deep_ep here would load" in capsys.readouterr().out
