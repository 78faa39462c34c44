#!/usr/bin/env bash
# scripts/make_token_file.py: text and JSON lines into an OOMTOK01 file that oom-train trains on
# (UTF-8 bytes: every byte a token, one document a file or a line); bad inputs named, the old
# output left whole; with transformers ($OOM_TEST_PYTHON), a Hugging Face tokenizer's ids and its
# EOS after each document. Usage: make_token_file.sh path/to/oom-train
set -euo pipefail
train="$1"
here="$(cd "$(dirname "$0")/../.." && pwd)"
make="$here/scripts/make_token_file.py"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

printf 'The planner splits GPU memory \xe2\x86\x92 experts.\n' > "$work/a.txt"
printf '{"text": "hello world"}\n\n{"text": "caf\\u00e9", "id": 2}\n' > "$work/b.jsonl"
python3 "$make" --bytes --out "$work/data.tok" "$work/a.txt" "$work/b.jsonl" > "$work/make.log"
bytes=$(( $(wc -c < "$work/a.txt") + 11 + 5 ))  # "hello world", "café" in UTF-8
read -r magic version width vocab count docs < <(python3 -c '
import struct, sys
b = open(sys.argv[1], "rb").read()
print(b[:8].decode(), *struct.unpack_from("<IIQQQ", b, 8))' "$work/data.tok")
[[ "$magic $version $width $vocab $count $docs" == "OOMTOK01 1 2 256 $bytes 3" ]] ||
  fail "header '$magic $version $width $vocab $count $docs', expected 'OOMTOK01 1 2 256 $bytes 3'"
grep -q "wrote .*data.tok: $bytes tokens (2 bytes each, vocab 256) in 3 documents" "$work/make.log" || fail "$(cat "$work/make.log")"
# oom-train takes it (the built-in model's vocab is 256).
"$train" --data "$work/data.tok" --seq 16 --steps 2 --out "$work/run" > "$work/train.log" || { cat "$work/train.log"; fail "oom-train"; }
grep -q "data $work/data.tok: $bytes tokens (vocab 256)" "$work/train.log" || fail "oom-train read $(grep '^data' "$work/train.log")"

# Every byte a token: a .txt file's CR LF and lone CR stay as they are (read in text mode, both had
# become LF, the file's bytes silently changed).
printf 'one\r\ntwo\rthree\n' > "$work/crlf.txt"
python3 "$make" --bytes --out "$work/crlf.tok" "$work/crlf.txt" > /dev/null
python3 -c '
import sys
from array import array
b, text = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
got = array("H", b[64:]).tolist()
assert got == list(text), (got, list(text))' "$work/crlf.tok" "$work/crlf.txt" || fail "crlf.txt's bytes changed"

# A UTF-8 byte order mark at the start of a file (Windows tools write one) is not text: dropped, and
# the files it was dropped from counted. One past the start is text and stays. (It had been 3 byte
# tokens of a .txt file, and a .jsonl file's first line was "not a JSON line".)
printf '\xef\xbb\xbfone\xef\xbb\xbftwo\r\n' > "$work/bom.txt"
printf '\xef\xbb\xbf{"text": "hi"}\n' > "$work/bom.jsonl"
python3 "$make" --bytes --out "$work/bom.tok" "$work/bom.txt" "$work/bom.jsonl" > "$work/bom.log" || fail "bom: $(cat "$work/bom.log")"
grep -q "in 2 documents; a UTF-8 byte order mark dropped from the start of 2 files$" "$work/bom.log" || fail "bom: $(cat "$work/bom.log")"
python3 -c '
import sys
got = open(sys.argv[1], "rb").read()[64::2]
assert got == b"one\xef\xbb\xbftwo\r\nhi", got' "$work/bom.tok" || fail "bom: the tokens"
python3 "$make" --bytes --out "$work/bom.tok" "$work/a.txt" > "$work/bom.log"
grep -q "in 1 document$" "$work/bom.log" || fail "no BOM, yet: $(cat "$work/bom.log")"

# An extension in capitals or mixed case is the same (.JSONL had been read as one text document,
# its JSON syntax the tokens), and .json is JSON lines too (what datasets' to_json writes).
printf '{"text": "up"}\n{"text": "per"}\n' > "$work/c.JSONL"
printf '{"text": "mix"}\n' > "$work/d.JsonL"
printf '{"text": "js"}\n{"text": "on"}\n' > "$work/e.Json"
python3 "$make" --bytes --out "$work/case.tok" "$work/c.JSONL" "$work/d.JsonL" "$work/e.Json" > "$work/case.log"
grep -q ": 12 tokens (2 bytes each, vocab 256) in 5 documents$" "$work/case.log" || fail "case: $(cat "$work/case.log")"

# A document with no tokens is skipped and counted: an empty file, one of a byte order mark alone,
# "text": "" (they had each been a document of nothing, or of a lone EOS with a tokenizer). A blank
# line is no record, as before; a file of whitespace is text.
: > "$work/none.txt"
printf '\xef\xbb\xbf' > "$work/bom-only.md"
printf '{"text": ""}\n\n{"text": "x"}\n' > "$work/empty.jsonl"
printf '\n' > "$work/newline.txt"
python3 "$make" --bytes --out "$work/empty.tok" "$work/none.txt" "$work/bom-only.md" "$work/empty.jsonl" "$work/newline.txt" > "$work/empty.log"
grep -q ": 2 tokens (2 bytes each, vocab 256) in 2 documents; 3 empty documents skipped; " "$work/empty.log" || fail "empty: $(cat "$work/empty.log")"

# Streamed: a 64 MiB .txt file is read a MiB at a time, so the run peaks far below the file's size
# (it held the file ~11 times over: its text, its bytes, a list of 8-byte ints and their array;
# 1.07 GiB for 97 MB). Its tokens are still its bytes exactly, across the seams between the reads:
# characters of 2 to 4 bytes and CR LF cut at them, a lone CR, no newline at the end.
python3 -c 'import sys; open(sys.argv[1], "wb").write("a\u2192\u5c02\U0001f600\r\n\r\u00e9b".encode() * (64 * 2**20 // 17))' "$work/big.txt"  # 17 bytes: the seams move
# Spawned from a small process: the child's ru_maxrss starts at its parent's high-water mark (vfork, exec).
peak=$(python3 -c '
import resource, subprocess, sys
subprocess.run([sys.executable] + sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)' "$make" --bytes --out "$work/big.tok" "$work/big.txt") ||
  fail "the big .txt file"
(( peak < 64 )) || fail "peak RSS $peak MiB for a 64 MiB .txt file"
python3 -c '
import sys
text, got = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
assert got[64::2] == text and not got[65::2].strip(b"\0"), "the tokens are not its bytes"' "$work/big.txt" "$work/big.tok" ||
  fail "the big .txt file's bytes changed"
echo "ok   big .txt: 64 MiB, peak RSS $peak MiB"
rm "$work/big.txt" "$work/big.tok"

# Bad inputs: named, and the old output left as it was.
cp "$work/data.tok" "$work/before.tok"
expect() {  # name, message part, then the arguments
  local name="$1" want="$2"
  shift 2
  if python3 "$make" --out "$work/data.tok" "$@" > "$work/$name.log" 2>&1; then fail "$name: succeeded"; fi
  grep -qF -- "$want" "$work/$name.log" || fail "$name: expected '$want', got: $(cat "$work/$name.log")"
  cmp -s "$work/data.tok" "$work/before.tok" || fail "$name: the old output changed"
  echo "ok   $name: $(tail -1 "$work/$name.log")"
}
printf '{"text": "fine"}\n{"text": \n' > "$work/broken.jsonl"
expect broken-json-line "broken.jsonl:2: not a JSON line" --bytes "$work/broken.jsonl"
printf '{"body": "x"}\n' > "$work/field.jsonl"
expect missing-field "field.jsonl:1: no string field 'text'" --bytes "$work/field.jsonl"
printf '[{"text": "x"}]\n' > "$work/array.json"
expect json-array "array.json:1: a JSON list, not an object" --bytes "$work/array.json"
expect missing-file "absent.txt: no such file" --bytes "$work/absent.txt"
# A directory is named as one (it had been "no such file"); a file named twice, also by another
# path, is refused (it had been tokenized twice).
mkdir -p "$work/corpus-dir"
expect directory-input "corpus-dir: a directory; name its files" --bytes "$work/corpus-dir"
printf 'twice\n' > "$work/twice.txt"
expect same-file-twice "the same file as $work/twice.txt, named twice" --bytes "$work/twice.txt" "$work/corpus-dir/../twice.txt"
printf '\xff\xfe' > "$work/latin.txt"
expect not-utf8 "latin.txt: not UTF-8 text" --bytes "$work/latin.txt"
python3 -c 'import sys; open(sys.argv[1], "wb").write(b"a" + "\u00e9".encode() * 700000 + b"\xff")' "$work/late.txt"
expect not-utf8-late "late.txt: not UTF-8 text (invalid start byte at byte 1400001)" --bytes "$work/late.txt"  # past the first read
: > "$work/empty.txt"
expect no-text "no tokens: the inputs hold no text (1 empty document)" --bytes "$work/empty.txt"
printf '{"text": "ok"}\n\xff{"text": "x"}\n' > "$work/bytes.jsonl"
expect jsonl-not-utf8 "bytes.jsonl:2: not UTF-8 text" --bytes "$work/bytes.jsonl"
printf '{"text": "\\ud800"}\n' > "$work/surrogate.jsonl"
expect lone-surrogate "surrogate.jsonl:1: text that UTF-8 cannot hold" --bytes "$work/surrogate.jsonl"
if python3 "$make" --bytes --out "$work/no/such/dir/x.tok" "$work/a.txt" > "$work/nodir.log" 2>&1; then fail "no-dir: succeeded"; fi
grep -q "no directory" "$work/nodir.log" || fail "no-dir: $(cat "$work/nodir.log")"
# --out one of the inputs (by another spelling too): refused, the text kept (it had been replaced
# by its tokens).
cp "$work/a.txt" "$work/self.txt"
if python3 "$make" --bytes --out "$work/./self.txt" "$work/b.jsonl" "$work/self.txt" > "$work/self.log" 2>&1; then fail "out-is-input: succeeded"; fi
grep -q "self.txt: is the input .*self.txt; writing it would destroy that input" "$work/self.log" && cmp -s "$work/a.txt" "$work/self.txt" ||
  fail "out-is-input: $(cat "$work/self.log")"
echo "ok   out-is-input: $(tail -1 "$work/self.log")"
# --out a directory: refused by name before any tokenizing (it had tokenized everything, then died
# in a traceback at the rename).
mkdir -p "$work/outdir"
if python3 "$make" --bytes --out "$work/outdir" "$work/a.txt" > "$work/outdir.log" 2>&1; then fail "out-dir: succeeded"; fi
grep -q "outdir: a directory" "$work/outdir.log" && ! grep -q Traceback "$work/outdir.log" || fail "out-dir: $(cat "$work/outdir.log")"
[[ -z "$(find "$work" -name '.make_token_file.*')" ]] || fail "a temporary file was left behind"
# Written as any new file is (mkstemp's own mode is the owner's alone).
python3 "$make" --bytes --out "$work/mode.tok" "$work/a.txt" > /dev/null
want=$(printf '%o' $(( 0666 & ~$(umask) )))
[[ "$(stat -c %a "$work/mode.tok")" == "$want" ]] || fail "mode $(stat -c %a "$work/mode.tok"), expected $want"

# A Hugging Face tokenizer (a BPE trained here: no network), where transformers is.
python="${OOM_TEST_PYTHON:-python3}"
if "$python" -c "import tokenizers, transformers" 2> /dev/null; then
  "$python" - "$work/tk" "$here/README.md" > /dev/null 2>&1 <<'PY'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel()
tok.train([sys.argv[2]], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(sys.argv[1])
PY
  "$python" "$make" --tokenizer "$work/tk" --out "$work/tk.tok" "$work/b.jsonl" "$work/none.txt" "$work/empty.jsonl" > /dev/null
  "$python" - "$work/tk" "$work/tk.tok" <<'PY' || fail "tokenizer ids"
import struct, sys
from array import array
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
want = []
for text in ("hello world", "café", "x"):  # no lone EOS for none.txt, nor for empty.jsonl's ""
    want += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
b = open(sys.argv[2], "rb").read()
_, width, vocab, count, docs = struct.unpack_from("<IIQQQ", b, 8)
got = array("H", b[64:]).tolist()
assert (width, vocab, count, docs) == (2, len(tok), len(want), 3), (width, vocab, count, docs)
assert got == want, (got, want)
print(f"ok   tokenizer: {count} ids, EOS after each of {docs} documents")
PY
else
  echo "(no tokenizers/transformers in $python: the tokenizer case skipped)"
fi
echo PASS
