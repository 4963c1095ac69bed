# Sourced by the scripts that spend a lent GPU (gpu_data_run.sh, gpu_train_run.sh). The embedded target travels as
# its GGUF in xz parts: `bash scripts/gpu_data_run.sh prepare` writes them to .gpu/ (with the gguf wheel and the
# SHA-256s in .gpu/sums); each device call but the last carries one part and stashes it in /root/g (`stash`), the
# last carries the last part, .gpu/whl and .gpu/sums, and `gpu_setup` puts the GGUF back together there.
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
G=/root/g/$GGUF_NAME
PY=python3; command -v python3 >/dev/null || PY=python

gpu_stash() {  # every call but the last: keep this call's part (/root stays while the machine is held)
    mkdir -p /root/g && cp .gpu/p? /root/g/ && ls -la /root/g
}

gpu_setup() {  # the last call: the GGUF rebuilt and checked, the gguf wheel installed; non-zero when anything fails
    mkdir -p /root/g && cp .gpu/p? /root/g/ 2>/dev/null
    (cd .gpu && sha256sum -c --ignore-missing --quiet sums) || return 1
    if [ "$(ls /root/g/p? | wc -l)" != "$(grep -c ' p[0-9]$' .gpu/sums)" ]; then
        echo "GGUF parts missing: $(ls /root/g); the calls before this one stash them (the machine must stay held" \
             "between calls: each within the warm window of the one before)"
        return 1
    fi
    cat /root/g/p? | xz -dc > "$G" || return 1
    sha256sum -c --quiet <(grep "/root/g/" .gpu/sums) || return 1
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl/*.whl || return 1
    export PYTHONPATH=/tmp/site:$PWD DDTREE_CACHE=/root/ddtree-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}
