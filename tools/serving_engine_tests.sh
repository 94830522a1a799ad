#!/usr/bin/env bash
# Runs vLLM's and SGLang's DeepEP wrapper modules (their own code, from their wheels; nothing of
# either engine is in this repository) against ep_comm's `deep_ep` on 2 CPU gloo ranks in spawned
# workers: tools/serving_engines_driver.py says what runs, what it is compared with and what is
# patched (only what needs a GPU or a running server).
#
#   tools/serving_engine_tests.sh [wheel dir] [engines venv] [python] [case name parts...]
#
# wheel dir: holds vllm-0.33.0-*.whl and sglang-0.5.23-*.whl (default /tmp/whl; e.g.
#   `pip download --no-deps vllm==0.33.0 sglang==0.5.23 -d /tmp/whl`).
# engines venv: created if absent (default /tmp/engines-venv), outside the repository. It sees the
#   packages of python's environment (torch, ep_comm) through a startup file, gets the two wheels
#   with --no-deps plus the few packages their DeepEP modules import, and ep_comm's `deep_ep` by
#   `python -m ep_comm.integrations.deep_ep enable` and EP_COMM_PROVIDE_DEEP_EP=1 (the opt-in switch
#   the engines' own workers would use).
# python: the interpreter whose environment has torch and ep_comm (default: this repository's .venv).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
wheels=${1:-/tmp/whl}
venv=${2:-/tmp/engines-venv}
py=${3:-$here/.venv/bin/python}
case "$(cd "$(dirname "$venv")" 2>/dev/null && pwd)/" in
    "$here"/*) echo "the engines venv must be outside the repository: $venv" >&2; exit 2 ;;
esac
# What the engines' DeepEP modules import beyond torch (found by importing them until nothing was missing).
deps=(psutil pyzmq urllib3 cbor2 aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
      requests certifi openai-harmony openai sniffio pybase64 cachetools msgspec uvloop py-cpuinfo xgrammar
      apache-tvm-ffi fastapi starlette opentelemetry-api prometheus-client partial-json-parser llguidance einops
      orjson ipython traitlets torchvision dill sentencepiece compressed-tensors loguru gguf)
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
    base=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # sorts before ep_comm_deep_ep.pth, whose line looks for ep_comm
    echo "import site; site.addsitedir('$base')" > "$site/a_base_environment.pth"
    "$venv/bin/pip" install -q --no-deps "$wheels"/vllm-0.33.0-*.whl "$wheels"/sglang-0.5.23-*.whl "${deps[@]}" \
        2> >(grep -v "WARNING: Location" >&2)
fi
"$venv/bin/python" -m ep_comm.integrations.deep_ep enable > /dev/null
cd "$here"
EP_COMM_PROVIDE_DEEP_EP=1 "$venv/bin/python" tools/serving_engines_driver.py "${@:4}" \
    2> >(grep -v -i -E "warn|^(\[rank[0-9]+\]:)?W[0-9]{4} |vllm\._C|Only use" >&2)
