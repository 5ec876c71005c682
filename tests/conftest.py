import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache per test session, also used by pytest-xdist's workers and the subprocesses
# the tests start (they inherit the environment; this file runs in the controller before the workers start). The suite compiles the same small programs many times over (every CLI run of the
# tiny default recipe, each mesh test's single-device reference), and a hit skips XLA's compiler; tracing,
# and so the programs counted by `jit`'s own cache, is unchanged. Fresh for each session and removed at its
# end, so nothing carries over from one run to the next. Set JAX_COMPILATION_CACHE_DIR to choose the folder.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxrl_tests_xla_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache every program, however quick
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# XLA's CPU backend without LLVM's optimisations (XLA's own HLO passes, fusion included, still run): the suite's
# programs are tiny, compiling them is most of its time, and this takes 7% off it (710 s vs 766 s, 2-core CPU,
# 2026-11-25). The subprocesses the tests start inherit it; those that set XLA_FLAGS append to it.
# pytest-xdist's workers import this file again with the flag already inherited: it is added once.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
