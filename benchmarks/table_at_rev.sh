# Sourced by kernel_ab.sh and step_ab.sh: one table of block kernels as a C file of its
# own, its getter renamed, in a folder with the headers it includes by "..." (which the
# compiler looks for beside the including file first).
#   table_at_rev ROOT TABLE REV NAME DIR
# writes DIR/table_NAME.c (and the headers) from git revision REV, or from the working
# tree when REV is "-": TABLE avx2 (csrc/core/block_avx2.c) or avx512bf16 / avx512vbmi
# (their .c file and the three AVX-512 kernel headers they share; the helpers of
# block_avx512.c they call stay the build's own). The getter gefen_block_ops_TABLE
# becomes gefen_block_ops_NAME, and block_avx512vbmi.c's one other global
# gefen_cpu_prefers_key_search gets the suffix _NAME. Fails (exit 2) on another table.
table_at_rev() {
  local root=$1 table=$2 rev=$3 name=$4 dir=$5 headers=() f
  case "$table" in
    avx2) ;;
    avx512bf16 | avx512vbmi)
      headers=(block_avx512_common.h block_avx512_kernels.h block_avx512vbmi_kernels.h) ;;
    *)
      echo "the table is avx2, avx512bf16 or avx512vbmi, not $table" >&2
      exit 2 ;;
  esac
  mkdir -p "$dir"
  for f in "block_$table.c" ${headers[@]+"${headers[@]}"}; do
    if [ "$rev" = - ]; then
      cp "$root/csrc/core/$f" "$dir/$f"
    else
      git -C "$root" show "$rev:csrc/core/$f" > "$dir/$f"
    fi
  done
  sed -e "s/gefen_block_ops_$table\b/gefen_block_ops_$name/g" \
    -e "s/gefen_cpu_prefers_key_search\b/gefen_cpu_prefers_key_search_$name/g" \
    "$dir/block_$table.c" > "$dir/table_$name.c"
  rm "$dir/block_$table.c"
}
