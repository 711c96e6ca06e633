"""What lvlm.py takes from transformers beyond its public API, checked against the release requirements.txt pins.

A new release may move these: this file fails first, naming what to check again (the family tests in
test_families.py then say whether answers and P(reply) still equal plain transformers')."""

import inspect
from pathlib import Path

import transformers
from transformers import GenerationMixin, ProcessorMixin

from icl_select import hf


def pinned(package: str) -> str:
    lines = (Path(__file__).resolve().parent.parent / "requirements.txt").read_text().splitlines()
    return next(line.split("==")[1] for line in lines if line.startswith(f"{package}=="))


def test_the_pinned_transformers_is_the_one_installed():
    assert transformers.__version__ == pinned("transformers"), (
        "transformers changed: check hf.generation_positions and hf.image_only against the new release"
    )


def test_generation_positions_calls_what_generate_calls():
    method = GenerationMixin._prepare_position_ids_for_generation
    assert list(inspect.signature(method).parameters) == ["self", "inputs_tensor", "model_kwargs"]
    assert "_prepare_position_ids_for_generation" in inspect.getsource(GenerationMixin.generate)
    assert "_prepare_position_ids_for_generation" in inspect.getsource(hf.generation_positions)


def test_image_only_overrides_the_methods_processors_load_with():
    """from_pretrained reads the processor's settings through get_processor_dict and loads one sub-processor per name
    that get_attributes lists: image_only leaves video_processor out of both."""
    for name in ("get_attributes", "get_processor_dict"):
        assert isinstance(inspect.getattr_static(ProcessorMixin, name), classmethod), name
    load = inspect.getsource(ProcessorMixin.from_pretrained.__func__)
    assert "cls.get_processor_dict(" in load and "cls._get_arguments_from_pretrained(" in load
    assert "cls.get_attributes()" in inspect.getsource(ProcessorMixin._get_arguments_from_pretrained.__func__)
    video = transformers.Qwen2_5_VLProcessor
    assert "video_processor" in video.get_attributes()
    assert "video_processor" not in hf.image_only(video).get_attributes()
