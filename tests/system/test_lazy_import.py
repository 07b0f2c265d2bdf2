"""``import dfllm`` is lazy: the engine imports without the dataframe stack (Dask, distributed,
Polars, the accessors, the jobs), and ``.llm`` is on each installed library whichever of it and
dfllm is imported first. Each check runs in a fresh interpreter, so that what it imports is its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import dfllm

pytestmark = pytest.mark.slow

#: Makes the named packages look uninstalled: a finder ahead of all others refuses them.
BLOCK = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

BLOCKED = set(sys.argv.pop().split(","))
sys.meta_path.insert(0, Block())
"""

#: Never imported by the engine (nor by ``from dfllm import LLM``).
DATAFRAME_STACK = ("dask", "distributed", "polars", "dfllm.accessors", "dfllm.jobs", "dfllm.tasks", "dfllm.worker")

CHECK_OUT = f"""
import sys
loaded = [name for name in {DATAFRAME_STACK!r} if name in sys.modules]
assert not loaded, loaded
"""


def run(*code: str, args: tuple[str, ...] = (), blocked: tuple[str, ...] = ()) -> str:
    """Runs the pieces of ``code`` in a fresh interpreter (warnings are errors, ``args`` its
    ``sys.argv[1:]``), with the ``blocked`` packages missing, and returns its output."""
    source = (BLOCK if blocked else "") + "".join(textwrap.dedent(piece) for piece in code)
    command = [sys.executable, "-W", "error", "-c", source, *args, *([",".join(blocked)] if blocked else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_engine_runs_without_dask_distributed_polars(tiny_llama):
    out = run(
        """
        import sys
        from dfllm import LLM, SamplingParams
        """,
        CHECK_OUT,
        """
        llm = LLM(sys.argv[1], max_num_seqs=2, max_model_len=64, kv_cache_memory_bytes=2**22)
        [result] = llm.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0))
        assert len(result.outputs[0].token_ids) == 4, result
        """,
        CHECK_OUT,
        """
        import dfllm
        try:
            dfllm.write_parquet
        except ModuleNotFoundError as exc:
            assert exc.name == "dask" and "pip install dask[distributed]" in str(exc), exc
            print(exc)
        else:
            raise AssertionError("write_parquet without dask")
        import pandas as pd
        print(type(pd.DataFrame({"q": ["x"]}).llm).__name__)
        """,
        args=(str(tiny_llama),),
        blocked=("dask", "distributed", "polars"),
    )
    assert "dfllm.write_parquet needs dask, which is not installed: pip install dask[distributed]" in out
    assert out.strip().endswith("PandasLLMAccessor")


@pytest.mark.parametrize(
    "statement", ["import dfllm.engine.scheduler", "import dfllm.engine.llm_engine", "from dfllm import LLM"]
)
def test_the_engine_imports_without_the_dataframe_stack(statement):
    run(statement + "\n", CHECK_OUT)


#: ``.llm`` on every library, of dfllm's classes, registered without a warning.
CHECK_LLM = """
import dask.dataframe as dd
import pandas as pd
import polars as pl

df = pd.DataFrame({"q": ["x"]})
ddf = dd.from_pandas(df, npartitions=1)
found = {
    "pandas": (df.llm, df.q.llm, pd.DataFrame.llm),
    "dask": (ddf.llm, ddf.q.llm),
    "polars": (pl.from_pandas(df).llm, pl.LazyFrame({"q": ["x"]}).llm, pl.col("q").llm),
}
print({library: [type(a).__name__ if not isinstance(a, type) else a.__name__ for a in accessors]
       for library, accessors in found.items()})
"""
EXPECTED = {
    "pandas": ["PandasLLMAccessor", "PandasSeriesLLMAccessor", "PandasLLMAccessor"],
    "dask": ["DaskLLMAccessor", "DaskSeriesLLMAccessor"],
    "polars": ["PolarsLLMNamespace", "PolarsLazyLLMNamespace", "PolarsExprLLMNamespace"],
}


@pytest.mark.parametrize(
    "first",
    [
        "import dask.dataframe as dd, pandas as pd, polars as pl\nimport dfllm",  # the libraries, then dfllm
        "import dfllm",  # dfllm, then the libraries
        "import pandas as pd\nimport dfllm\nimport polars as pl",  # some before, some after
        "import dfllm.engine.scheduler",  # a dfllm module only: the root runs all the same
    ],
)
def test_llm_namespaces_whichever_is_imported_first(first):
    out = run(first + "\n", CHECK_LLM)
    assert out.strip() == str(EXPECTED)


def test_blocked_polars_leaves_pandas_and_dask():
    out = run(
        """
        import dfllm
        import dask.dataframe as dd
        import pandas as pd
        print(type(dd.from_pandas(pd.DataFrame({"q": ["x"]}), npartitions=1).llm).__name__)
        try:
            import polars
        except ModuleNotFoundError:
            print("no polars")
        """,
        blocked=("polars",),
    )
    assert out.splitlines() == ["DaskLLMAccessor", "no polars"]


def test_a_failed_registration_says_what_is_missing_and_tries_again():
    out = run(
        """
        import dfllm
        import dask.dataframe as dd
        import pandas as pd
        import dfllm.accessors.dask_ext as dask_ext

        def register():
            raise ModuleNotFoundError("No module named 'distributed'", name="distributed")

        real, dask_ext.register = dask_ext.register, register
        ddf = dd.from_pandas(pd.DataFrame({"q": ["x"]}), npartitions=1)
        for _ in range(2):  # the stand-in stays, and says the same again
            try:
                ddf.llm
            except ModuleNotFoundError as exc:
                print(exc)
        dask_ext.register = real
        print(type(ddf.llm).__name__)
        """
    )
    message = "dask.dataframe's .llm needs distributed, which is not installed: pip install dask[distributed]"
    assert out.splitlines() == [message, message, "DaskLLMAccessor"]


def test_first_uses_on_many_threads_at_once():
    # the first .llm imports dfllm's pandas module (a second or so); the threads that come
    # meanwhile wait for it rather than find no .llm
    out = run(
        """
        import threading
        from concurrent.futures import ThreadPoolExecutor

        import dfllm
        import pandas as pd

        df = pd.DataFrame({"q": ["x"]})
        barrier = threading.Barrier(8)

        def use(i):
            barrier.wait()
            return type(df.llm if i % 2 else df.q.llm).__name__

        with ThreadPoolExecutor(8) as pool:
            print(sorted(set(pool.map(use, range(8)))))
        """
    )
    assert out.strip() == str(["PandasLLMAccessor", "PandasSeriesLLMAccessor"])


def test_public_names_resolve_on_use():
    assert set(dfllm.__all__) <= set(dir(dfllm))
    for name in dfllm.__all__:
        value = getattr(dfllm, name)
        assert value.__name__ in (name, "InvalidRequestError")  # VLLMValidationError: vLLM's alias
        assert vars(dfllm)[name] is value  # kept: looked up once
    assert isinstance(dfllm.__version__, str)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dfllm.nope  # noqa: B018
