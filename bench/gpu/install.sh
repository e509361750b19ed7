#!/usr/bin/env bash
# install.sh PART...: on the GPU machine, from the repo root, install staged parts (bench/gpu/stage.sh).
#   p1   sglang, flashinfer, sglang-kernel -> /root/stage/site; eaglet's wheels -> /root/stage/esite;
#        redis-server -> /root/stage/redis; eaglet's SGLang plugin (from this tree) -> /root/stage/plugin_site;
#        eaglet itself (from this tree) -> /root/stage/esite
#   p2   the rest of SGLang's dependencies -> /root/stage/site; tokenizer -> /root/stage/tokenizer
#   p3   SpecForge 0.2.0 -> /root/stage/sfsite (its own folder: eaglet's runs never see it); the HumanEval
#        prompts -> /root/stage/humaneval (bench/gpu/stage-specforge.sh)
#   m1 m2 m3   parts of the SmolLM2 GGUF -> /root/stage/gguf (joined and checked once all three are there)
#   g1..g5     parts of the Gemma 3 270M GGUF -> /root/stage/gemma3 (bench/gpu/stage-gemma3.sh; joined the same way)
# A part already installed while the machine stays up is skipped. Prints what it did.
set -euo pipefail
S=/root/stage
mkdir -p $S/site $S/esite $S/plugin_site $S/gguf $S/gemma3
PIPI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
for PART in "$@"; do
  name=$(basename "$PART")
  if [ -f "$S/$name.done" ]; then echo "$name already installed"; continue; fi
  t0=$(date +%s)
  case $name in
    p1|p2|pr)
      whls=$(ls "$PART"/*.whl 2>/dev/null || true)
      [ -n "$whls" ] && $PIPI --target $S/site $whls
      if [ -d "$PART/eaglet" ]; then $PIPI --target $S/esite "$PART"/eaglet/*.whl; fi
      if [ -d "$PART/redis" ]; then rm -rf $S/redis; cp -r "$PART/redis" $S/redis; chmod +x $S/redis/bin/*; fi
      [ -f "$PART/tokenizer.tgz" ] && tar -C $S -xzf "$PART/tokenizer.tgz"
      python3 -c "import IPython" 2>/dev/null || cp -r bench/gpu/shims/IPython $S/site/
      ;;
    p3)
      rm -rf $S/sfsite; $PIPI --target $S/sfsite "$PART"/specforge-*.whl
      mkdir -p $S/humaneval; cp "$PART/HumanEval.jsonl.gz" $S/humaneval/
      ;;
    m1|m2|m3) cp "$PART"/* $S/gguf/ ;;
    g1|g2|g3|g4|g5) cp "$PART"/* $S/gemma3/ ;;
    *) echo "unknown part $name"; exit 2 ;;
  esac
  touch "$S/$name.done"
  echo "installed $name in $(( $(date +%s) - t0 )) s"
done
# eaglet's plugin, always from this tree (a fix travels with the tree): a distribution with the entry point.
# eaglet too, beside its dependencies: its folders (cli/, services/, shared/) are eaglet.* only once installed
# (pyproject.toml's package-dir). Each is built from a fresh copy, so no earlier build's files ride along.
if [ -f $S/p1.done ]; then
  rm -rf $S/plugin_site; mkdir -p $S/plugin_site
  rm -rf /root/plugbuild; cp -r services/inference/sglang_plugin /root/plugbuild; rm -rf /root/plugbuild/*.egg-info
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target $S/plugin_site /root/plugbuild \
    >/root/plugbuild.log 2>&1 || { echo "plugin install failed:"; tail -20 /root/plugbuild.log; }
  rm -rf /root/eagletbuild; mkdir /root/eagletbuild; cp -r pyproject.toml README.md cli services shared /root/eagletbuild/
  $PIPI --no-build-isolation --target $S/esite /root/eagletbuild \
    >/root/eagletbuild.log 2>&1 || { echo "eaglet install failed:"; tail -20 /root/eagletbuild.log; }
fi
if [ -f $S/gguf/gguf.part0 ] && [ -f $S/gguf/gguf.part1 ] && [ -f $S/gguf/gguf.part2 ] && [ ! -f $S/gguf/model.gguf ]; then
  cat $S/gguf/gguf.part0 $S/gguf/gguf.part1 $S/gguf/gguf.part2 > $S/gguf/model.gguf
  [ "$(sha256sum $S/gguf/model.gguf | cut -d' ' -f1)" = "$(cat $S/gguf/gguf.sha256)" ] && echo "gguf joined, checksum ok" \
    || { echo "gguf checksum mismatch"; rm -f $S/gguf/model.gguf; }
fi
G=$S/gemma3
if [ -f $G/gguf.sha256 ] && ls $G/gguf.part1 $G/gguf.part2 $G/gguf.part3 $G/gguf.part4 $G/gguf.part5 >/dev/null 2>&1 \
    && [ ! -f $G/model.gguf ]; then
  cat $G/gguf.part1 $G/gguf.part2 $G/gguf.part3 $G/gguf.part4 $G/gguf.part5 > $G/model.gguf
  [ "$(sha256sum $G/model.gguf | cut -d' ' -f1)" = "$(cat $G/gguf.sha256)" ] && echo "gemma3 gguf joined, checksum ok" \
    || { echo "gemma3 gguf checksum mismatch"; rm -f $G/model.gguf; }
fi
