# sourced by each call's run.sh: GGUF parts to /root/gguf, binaries to /root/bin, /work/main
D=$1; source $D/device-env.sh > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $OUT/env.txt
mkdir -p /root/gguf /root/bin /work; for p in $D/p?; do cp $p /root/gguf/; done
for f in $D/*.xz; do n=$(basename $f .xz); [ $n = input.txt ] && continue; xz -dc -T8 $f > /root/bin/$n; chmod +x /root/bin/$n; done
ln -sfn "$PWD" /work/main
B=/root/bin
