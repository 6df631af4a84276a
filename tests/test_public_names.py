"""The names `import pagedjax` offers: listed by dir() (for completion and discovery) though the
engine's are imported lazily, so importing pagedjax alone stays cheap (no JAX)."""
import subprocess
import sys

import pagedjax


def test_dir_lists_every_public_name():
    names = dir(pagedjax)
    for name in pagedjax.__all__:
        assert name in names and getattr(pagedjax, name) is not None
    assert {"LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "SamplingParams", "__version__"} <= set(names)


def test_engine_config_is_exported_and_checks_its_fields():
    import pytest

    assert pagedjax.EngineConfig.__module__ == "pagedjax.config"
    with pytest.raises(ValueError, match="max_num_seqs"):
        pagedjax.EngineConfig(max_num_seqs=0)


def test_an_unknown_name_is_a_clear_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="module 'pagedjax' has no attribute 'NoSuchThing'"):
        pagedjax.NoSuchThing  # noqa: B018


def test_importing_pagedjax_does_not_import_jax():
    code = "import sys, pagedjax; dir(pagedjax); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
