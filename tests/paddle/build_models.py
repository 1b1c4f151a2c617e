"""PaddleOCR inference models for the ``ocr_paddle`` tests, converted from the PP-OCR models in rapidocr.

No PaddleOCR model can be downloaded where the tests run, but the ``rapidocr`` wheel ships PaddleOCR's
PP-OCRv6 small detection and recognition models as ONNX. This converts both with x2paddle into Paddle
inference models and writes beside each the ``inference.yml`` that PaddleX 3.x reads, laid out as the
``ocr_paddle`` scorer expects::

    OUT/ocr_paddle/det/{inference.json, inference.pdiparams, inference.yml}   PP-OCRv6_small_det
    OUT/ocr_paddle/rec/{inference.json, inference.pdiparams, inference.yml}   PP-OCRv6_small_rec

The pre- and post-processing settings are rapidocr's for these models (its ``config.yaml``), written in
the layout of PaddleX's own ``inference.yml`` files; the recogniser's character list is the one stored in
the rec ONNX model's metadata. ``OUT/ocr_paddle/SOURCE`` records a fingerprint of the ONNX files, the
converter versions and this script: a run whose fingerprint matches does nothing.

Runs under ``.venv-paddle`` (``make paddle-env``)::

    .venv-paddle/bin/python tests/paddle/build_models.py [OUT]   # OUT: .cache/rewardflow/paddleocr-models
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import helper, numpy_helper, shape_inference

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".cache/rewardflow/paddleocr-models"
DET_ONNX = "PP-OCRv6_det_small.onnx"
REC_ONNX = "PP-OCRv6_rec_small.onnx"
# x2paddle 1.6 needs onnx 1.15, which refuses IR version 10 (these models use no IR 9 or 10 feature).
ONNX_IR_VERSION = 8
CONVERTERS = ("paddlepaddle", "x2paddle", "onnx")

_DECODE_BGR = {"DecodeImage": {"channel_first": False, "img_mode": "BGR"}}

DET_CONFIG = {
    "Global": {"model_name": "PP-OCRv6_small_det"},
    "PreProcess": {
        "transform_ops": [
            _DECODE_BGR,
            {"DetResizeForTest": {"limit_side_len": 736, "limit_type": "min"}},
            {"NormalizeImage": {"mean": [0.5] * 3, "std": [0.5] * 3, "scale": "1./255.", "order": "hwc"}},
            {"ToCHWImage": None},
            {"KeepKeys": {"keep_keys": ["image", "shape"]}},
        ]
    },
    "PostProcess": {
        "name": "DBPostProcess",
        "thresh": 0.3,
        "box_thresh": 0.5,
        "unclip_ratio": 1.6,
        "max_candidates": 1000,
        "use_dilation": True,
        "score_mode": "fast",
    },
}

REC_CONFIG = {
    "Global": {"model_name": "PP-OCRv6_small_rec"},
    "PreProcess": {
        "transform_ops": [
            _DECODE_BGR,
            {"RecResizeImg": {"image_shape": [3, 48, 320]}},
            {"KeepKeys": {"keep_keys": ["image"]}},
        ]
    },
    "PostProcess": {"name": "CTCLabelDecode", "character_dict": None},  # from the ONNX metadata
}


def rapidocr_models_dir() -> Path:
    """The ``models`` folder of the installed rapidocr package, found without importing rapidocr (its
    runtime dependencies are not installed here)."""
    spec = importlib.util.find_spec("rapidocr")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("rapidocr is not installed in this environment: run `make paddle-env`")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def fingerprint(sources: list[Path]) -> dict[str, str]:
    """What the converted models depend on: the ONNX files, the converter versions and this script."""
    record = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sources}
    record.update({name: importlib.metadata.version(name) for name in CONVERTERS})
    record["build_models.py"] = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return record


def onnx_characters(model: onnx.ModelProto) -> list[str]:
    """The recogniser's character list, one per line of the ONNX model's ``character`` metadata."""
    metadata = {prop.key: prop.value for prop in model.metadata_props}
    if "character" not in metadata:
        raise SystemExit("the rec ONNX model has no 'character' metadata")
    return metadata["character"].splitlines()


def upsample_by_transposed_conv(model: onnx.ModelProto) -> int:
    """Replace each nearest-neighbour ``Resize`` by an integer factor ``f`` with the equal depthwise
    ``ConvTranspose`` (kernel and stride ``f``, weights 1); returns how many it replaced.

    x2paddle turns the Resize into ``nearest_interp`` with its scale as float64 values, which Paddle's
    oneDNN kernels cannot take (``ConvertPirAttribute2RuntimeAttribute not support``), and oneDNN is
    PaddleOCR's default on the CPU. The ``asymmetric``/``floor`` Resize copies input pixel ``i // f`` to
    output pixel ``i``, exactly what the transposed convolution computes.
    """
    graph = model.graph
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}
    shapes = {
        value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        for value in shape_inference.infer_shapes(model).graph.value_info
    }
    nodes, replaced = [], 0
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        scales = constants.get(node.input[2]) if node.op_type == "Resize" and len(node.input) == 3 else None
        if scales is not None and attributes == {
            "mode": b"nearest",
            "coordinate_transformation_mode": b"asymmetric",
            "nearest_mode": b"floor",
        }:
            factor, count = int(scales[2]), shapes.get(node.input[0], [0, 0])[1]  # NCHW
            if scales.tolist() != [1, 1, factor, factor] or count <= 0:
                raise SystemExit(f"{node.name}: unexpected scales {scales.tolist()} or channels {count}")
            weight = numpy_helper.from_array(np.ones((count, 1, factor, factor), np.float32), f"{node.name}.w")
            graph.initializer.append(weight)
            node = helper.make_node(
                "ConvTranspose",
                [node.input[0], weight.name],
                list(node.output),
                name=node.name,
                group=count,
                kernel_shape=[factor, factor],
                strides=[factor, factor],
            )
            replaced += 1
        nodes.append(node)
    used = {name for node in nodes for name in node.input}
    unused = [tensor for tensor in graph.initializer if tensor.name not in used]  # the Resize scales
    for tensor in unused:
        graph.initializer.remove(tensor)
    del graph.node[:]
    graph.node.extend(nodes)
    return replaced


def x2paddle(source: Path, out: Path) -> None:
    """x2paddle's ONNX-to-Paddle conversion of ``source`` into ``out``. Run in a fresh process per model:
    x2paddle names parameters after their op, and a second model in the same process collides."""
    # x2paddle checks the version as ``onnx.version.version``, a name onnx no longer exports, and
    # returns without converting when it is missing.
    onnx.version = types.SimpleNamespace(version=onnx.__version__)
    from x2paddle.convert import onnx2paddle

    onnx2paddle(str(source), str(out), convert_to_lite=False, disable_feedback=True)


def convert(source: Path, model_dir: Path, config: dict, work: Path) -> None:
    """Convert one ONNX model into the Paddle inference model dir ``model_dir`` with its inference.yml."""
    model = onnx.load(str(source))
    model.ir_version = ONNX_IR_VERSION
    upsample_by_transposed_conv(model)
    lowered = work / source.name
    onnx.save(model, str(lowered))
    if config["PostProcess"]["name"] == "CTCLabelDecode":
        config = {**config, "PostProcess": {**config["PostProcess"], "character_dict": onnx_characters(model)}}

    out = work / source.stem
    command = [sys.executable, __file__, "--x2paddle", str(lowered), str(out)]
    run = subprocess.run(command, capture_output=True, text=True, check=False)  # x2paddle is verbose
    exported = out / "inference_model"
    if run.returncode != 0 or not (exported / "model.json").is_file():
        raise SystemExit(f"x2paddle did not convert {source} (exit {run.returncode}):\n{run.stderr[-4000:]}")
    model_dir.mkdir(parents=True)
    shutil.copyfile(exported / "model.json", model_dir / "inference.json")
    shutil.copyfile(exported / "model.pdiparams", model_dir / "inference.pdiparams")
    with open(model_dir / "inference.yml", "w", encoding="utf-8") as file:
        yaml.safe_dump(config, file, allow_unicode=True, sort_keys=False)


def build(out: Path) -> bool:
    """Build ``out/ocr_paddle`` unless it is there and up to date; returns whether it built."""
    models = rapidocr_models_dir()
    sources = [models / DET_ONNX, models / REC_ONNX]
    expected = fingerprint(sources)
    target = out / "ocr_paddle"
    stamp = target / "SOURCE"
    if stamp.is_file() and json.loads(stamp.read_text()) == expected:
        return False
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        staged = Path(tmp) / "ocr_paddle"
        convert(sources[0], staged / "det", DET_CONFIG, Path(tmp))
        convert(sources[1], staged / "rec", REC_CONFIG, Path(tmp))
        (staged / "SOURCE").write_text(json.dumps(expected, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--x2paddle", nargs=2, type=Path, metavar=("ONNX", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.x2paddle:
        x2paddle(*args.x2paddle)
        return 0
    started = time.monotonic()
    built = build(args.out)
    state = f"converted in {time.monotonic() - started:.1f} s" if built else "up to date"
    print(f"PaddleOCR test models in {args.out / 'ocr_paddle'}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
