"""scripts/pretrain_gpt.py's own argument checks (in process: no distributed setup)."""
import importlib.util
import os
import re
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "pretrain_gpt.py")


@pytest.fixture(scope="module")
def pg():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv,match", [
    (["--virtual-pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1 \\(is 1\\)"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "0"], "needs a value >= 1"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3", "--num-layers", "4"],
     "--num-layers 4 is not a multiple of pipeline 2 x virtual 3"),
])
def test_virtual_pipeline_arguments_are_checked(pg, capsys, argv, match):
    with pytest.raises(SystemExit):
        pg.parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_virtual_pipeline_of_one_is_no_virtual_pipeline(pg):
    a = pg.parse_args(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "1"])
    assert a.virtual_pipeline_model_parallel_size is None
    a = pg.parse_args(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"])
    assert a.virtual_pipeline_model_parallel_size == 2
