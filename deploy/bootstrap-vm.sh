#!/usr/bin/env bash
# Prepare a GPU VM for rlfleet: a Python environment with the `train` extra, a check that
# nvidia-smi works, and the host key line to put in the control host's known_hosts.
#
# Run it on the VM, e.g. from the control host:
#   ssh ubuntu@gpu-box-1 'bash -s' < deploy/bootstrap-vm.sh
#   ssh ubuntu@gpu-box-1 'bash -s -- --source "git+https://example.com/rlfleet.git"' < deploy/bootstrap-vm.sh
#
# Options:
#   --venv DIR         the environment to create or reuse (default: ~/.rlfleet/venv)
#   --python PY        interpreter to create it with (default: python3, needs >= 3.11)
#   --source SPEC      what to pip install, without the extra (default: rlfleet; a path,
#                      a git+https URL or a wheel work too); `[train]` is added
#   --no-install       create/reuse the environment but install nothing (tests, or a
#                      prepared image)
#   --allow-no-gpu     do not fail when nvidia-smi is missing or broken (CPU-only trials)
#   --host-key FILE    public host key to print (default: the first of
#                      /etc/ssh/ssh_host_{ed25519,ecdsa,rsa}_key.pub)
#   --hostname NAME    the name the control host uses for this VM (default: hostname -f)
#   --port N           the SSH port the control host uses (default: 22)
#   --job-user NAME    run this VM's jobs as the Unix account NAME, not as this one (see
#                      deploy/README.md, "Jobs under their own account"): creates NAME
#                      when missing (with a home of its own), adds this account to NAME's
#                      group, installs /etc/sudoers.d/rlfleet-job-user-<this account>
#                      (`<this account> ALL=(NAME) NOPASSWD: ALL`, checked with visudo -c),
#                      lets group NAME search (only) this account's home, and keeps ~/.aws
#                      and ~/.rlfleet/env to this account (0700/0600). Needs root, or sudo
#                      to root, once; then `rlfleet vm add ... --job-user NAME`.
#   --cgroup-root DIR  the cgroup v2 directory under which each attempt gets a cgroup of its
#                      own (so that every process it starts stops with it), written to
#                      ~/.rlfleet/env as RLFLEET_CGROUP_ROOT; `none`: no cgroups (the
#                      environment marker only). Default: the cgroup the account's shell is
#                      in, when it may write it. See docs/security.md, "Stopping an attempt".
#
# Exit codes: 0 ready; 1 a check failed (the message says which); 2 bad usage.
set -euo pipefail

VENV="${HOME}/.rlfleet/venv"
PYTHON=python3
SOURCE=rlfleet
INSTALL=1
ALLOW_NO_GPU=0
HOST_KEY=""
HOSTNAME_FOR_KEY=""
PORT=22
JOB_USER=""
CGROUP_ROOT=""

die() { echo "bootstrap-vm: error: $*" >&2; exit 1; }
usage() { echo "bootstrap-vm: $*" >&2; echo "see the header of deploy/bootstrap-vm.sh for options" >&2; exit 2; }
step() { echo "==> $*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
    --python) PYTHON="${2:?--python needs an interpreter}"; shift 2 ;;
    --source) SOURCE="${2:?--source needs a pip requirement}"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --allow-no-gpu) ALLOW_NO_GPU=1; shift ;;
    --host-key) HOST_KEY="${2:?--host-key needs a file}"; shift 2 ;;
    --hostname) HOSTNAME_FOR_KEY="${2:?--hostname needs a name}"; shift 2 ;;
    --port) PORT="${2:?--port needs a number}"; shift 2 ;;
    --job-user) JOB_USER="${2:?--job-user needs a user name}"; shift 2 ;;
    --cgroup-root) CGROUP_ROOT="${2:?--cgroup-root needs a directory or none}"; shift 2 ;;
    -h|--help)
      if [ -f "$0" ]; then sed -n '2,/^set -euo/p' "$0" | sed '$d'; else echo "options: see the header of deploy/bootstrap-vm.sh"; fi
      exit 0 ;;
    --) shift; break ;;
    *) usage "unknown option: $1" ;;
  esac
done
case "$PORT" in ''|*[!0-9]*) usage "--port must be a number, not '$PORT'" ;; esac
if [ -n "$JOB_USER" ]; then
  # The same rule as `rlfleet vm add --job-user` (scheduler/remote/jobuser.py).
  printf '%s' "$JOB_USER" | grep -qxE '[a-z_][a-z0-9_-]{0,31}' \
    || usage "--job-user must be a POSIX user name (lowercase letters, digits, '_' or '-'), not '$JOB_USER'"
  [ "$JOB_USER" != root ] || usage "--job-user cannot be root"
  [ "$JOB_USER" != "$(id -un)" ] || usage "--job-user must not be the account the scheduler logs in as"
fi
case "$CGROUP_ROOT" in
  ""|none) ;;
  *[!A-Za-z0-9_./@:+=,-]*|*/../*|*/..|*/./*|*//*|[!/]*)
    usage "--cgroup-root must be an absolute plain path (or none), not '$CGROUP_ROOT'" ;;
esac

# 1. The Python environment.
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python >= 3.11"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$PYTHON is $("$PYTHON" -V 2>&1); rlfleet needs Python >= 3.11"
if [ -x "$VENV/bin/python" ]; then
  step "reusing the environment in $VENV"
else
  step "creating the environment in $VENV"
  mkdir -p "$(dirname "$VENV")"
  if [ "$INSTALL" = 1 ]; then
    "$PYTHON" -m venv "$VENV" || die "could not create $VENV (on Debian/Ubuntu: apt install python3-venv)"
  else
    "$PYTHON" -m venv --without-pip "$VENV" || die "could not create $VENV"
  fi
fi
VPY="$VENV/bin/python"

# 2. nvidia-smi (checked before the long install, so a broken driver is reported at once).
step "checking nvidia-smi"
GPU_LINES=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  [ "$ALLOW_NO_GPU" = 1 ] || die "nvidia-smi not found: install the NVIDIA driver (or pass --allow-no-gpu)"
  echo "    nvidia-smi not found; continuing because of --allow-no-gpu (jobs will run on CPU)"
elif ! GPU_LINES="$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1)"; then
  [ "$ALLOW_NO_GPU" = 1 ] || die "nvidia-smi failed: $(printf '%s' "$GPU_LINES" | head -n 1)"
  echo "    nvidia-smi failed; continuing because of --allow-no-gpu"
  GPU_LINES=""
elif printf '%s\n' "$GPU_LINES" | grep -qiE 'unable to determine|fallen off the bus|gpu is lost'; then
  die "a GPU is lost: $(printf '%s\n' "$GPU_LINES" | grep -iE 'unable|fallen|lost' | head -n 1)"
else
  printf '%s\n' "$GPU_LINES" | sed 's/^/    GPU /'
  echo "    $(printf '%s\n' "$GPU_LINES" | grep -c .) GPU(s)"
fi

# 3. rlfleet with the `train` extra.
if [ "$INSTALL" = 1 ]; then
  step "installing ${SOURCE}[train] (PyTorch, TRL…: this takes a few minutes)"
  "$VPY" -m pip install -q --upgrade pip
  if [ -z "$GPU_LINES" ]; then
    # No GPU: the CPU build of torch avoids gigabytes of CUDA wheels.
    "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
  "$VPY" -m pip install -q "${SOURCE}[train]" || die "pip install ${SOURCE}[train] failed"
  "$VPY" -c 'import training.train_grpo, trl, torch' \
    || die "the environment cannot import training.train_grpo"
  step "training entry point works: $("$VPY" -m training.train_grpo --help >/dev/null && echo ok)"
else
  step "skipping the install (--no-install)"
fi

# 4. ~/.rlfleet/env: what every job gets in its environment (jobs start with a clean one).
ENV_FILE="${HOME}/.rlfleet/env"
if [ -e "$ENV_FILE" ]; then
  chmod 0600 "$ENV_FILE"
  step "keeping $ENV_FILE (mode 0600)"
else
  step "creating $ENV_FILE (mode 0600): put HF_TOKEN, WANDB_API_KEY, proxies there"
  mkdir -p "$(dirname "$ENV_FILE")"
  ( umask 077 && cat > "$ENV_FILE" <<'ENVEOF'
# Variables every rlfleet job on this VM gets, one KEY=VALUE per line (read, never run as
# shell code; quotes around a value are removed). Jobs inherit nothing else but PATH,
# HOME, USER, LOGNAME, SHELL, LANG/LC_*, TZ, TMPDIR and the scheduler's own variables.
#HF_TOKEN=hf_...
#WANDB_API_KEY=...
#HTTPS_PROXY=http://proxy.internal:3128
#HF_HUB_OFFLINE=1
ENVEOF
  )
fi

# 4b. Where each attempt's cgroup is made (RLFLEET_CGROUP_ROOT in ~/.rlfleet/env).
if [ -n "$CGROUP_ROOT" ]; then
  ( umask 077 && { grep -v '^\(export \)\{0,1\}RLFLEET_CGROUP_ROOT=' "$ENV_FILE" || true; } > "$ENV_FILE.tmp" \
    && echo "RLFLEET_CGROUP_ROOT=$CGROUP_ROOT" >> "$ENV_FILE.tmp" && mv -f "$ENV_FILE.tmp" "$ENV_FILE" )
  step "attempts' cgroups: RLFLEET_CGROUP_ROOT=$CGROUP_ROOT in $ENV_FILE"
  if [ "$CGROUP_ROOT" != none ] && { [ ! -d "$CGROUP_ROOT" ] || [ ! -w "$CGROUP_ROOT/cgroup.procs" ]; }; then
    echo "bootstrap-vm: warning: $CGROUP_ROOT is not a cgroup v2 directory this account may write;" \
      "attempts fall back to the environment marker (rlfleet vm show says which a VM uses)" >&2
  fi
fi

# 5. The job user: jobs run as JOB_USER, started by this account through one sudo rule.
ADD_JOB_USER=""
if [ -n "$JOB_USER" ]; then
  ME="$(id -un)"
  step "setting up the job user $JOB_USER (jobs run as $JOB_USER, the scheduler as $ME)"
  if [ "$(id -u)" = 0 ]; then AS_ROOT=""; else AS_ROOT="sudo -n"; fi
  command -v sudo >/dev/null 2>&1 || die "sudo not found: install it (apt install sudo)"
  VISUDO="$(command -v visudo || echo /usr/sbin/visudo)"
  [ -z "$AS_ROOT" ] || sudo -n true 2>/dev/null || die "--job-user needs root once: run this as root, or as an account with sudo to root"
  if ! getent passwd "$JOB_USER" >/dev/null; then
    $AS_ROOT useradd --create-home --shell /bin/sh --user-group "$JOB_USER" || die "could not create $JOB_USER"
  fi
  $AS_ROOT usermod -a -G "$JOB_USER" "$ME" || die "could not add $ME to the group $JOB_USER"
  RULE="/etc/sudoers.d/rlfleet-job-user-$ME"  # sudo skips drop-ins whose name has a '.'
  DRAFT="$(mktemp)"
  # No tty: the scheduler's commands run without one (some distributions require one).
  printf '# rlfleet: %s starts jobs as %s (deploy/bootstrap-vm.sh --job-user)\nDefaults:%s !requiretty\n%s ALL=(%s) NOPASSWD: ALL\n' \
    "$ME" "$JOB_USER" "$ME" "$ME" "$JOB_USER" > "$DRAFT"
  $AS_ROOT "$VISUDO" -c -q -f "$DRAFT" || { rm -f "$DRAFT"; die "visudo refused the rule for $JOB_USER"; }
  $AS_ROOT install -m 0440 -o root -g root "$DRAFT" "$RULE" || { rm -f "$DRAFT"; die "could not install $RULE"; }
  rm -f "$DRAFT"
  $AS_ROOT "$VISUDO" -c -q || { $AS_ROOT rm -f "$RULE"; die "sudoers no longer parses with $RULE: removed it"; }
  # J may pass through this home to its attempts' directories, nothing more; what it must
  # never read stays this account's alone.
  $AS_ROOT chgrp "$JOB_USER" "$HOME" && chmod g=x,o-w "$HOME" || die "could not give $HOME to group $JOB_USER"
  [ ! -d "$HOME/.aws" ] || chmod 0700 "$HOME/.aws"
  [ ! -e "$HOME/.aws/credentials" ] || chmod 0600 "$HOME/.aws/credentials"
  chmod 0600 "$ENV_FILE"
  sudo -n -u "$JOB_USER" -- /bin/true </dev/null || die "sudo -n -u $JOB_USER does not work"
  step "jobs run as $JOB_USER: sudo -n -u $JOB_USER works"
  ADD_JOB_USER=" --job-user $JOB_USER"
fi

# 6. The host key line for the control host's known_hosts.
if [ -z "$HOST_KEY" ]; then
  for kind in ed25519 ecdsa rsa; do
    if [ -r "/etc/ssh/ssh_host_${kind}_key.pub" ]; then HOST_KEY="/etc/ssh/ssh_host_${kind}_key.pub"; break; fi
  done
fi
[ -n "$HOST_KEY" ] && [ -r "$HOST_KEY" ] || die "no readable SSH host key (pass --host-key FILE)"
NAME="${HOSTNAME_FOR_KEY:-$(hostname -f 2>/dev/null || hostname)}"
if [ "$PORT" = 22 ]; then HOST_FIELD="$NAME"; else HOST_FIELD="[$NAME]:$PORT"; fi
KEY_LINE="$HOST_FIELD $(awk '{print $1, $2}' "$HOST_KEY")"

step "ready. On the control host, trust this VM's host key:"
echo "    echo '$KEY_LINE' >> ~/.ssh/known_hosts"
echo "  (or compare it with: ssh-keyscan -p $PORT $NAME)"
step "and register it:"
echo "    rlfleet vm add $(printf '%s' "$NAME" | tr -c 'A-Za-z0-9._\n-' '-') --host $NAME --port $PORT --user $(id -un) --python $VPY$ADD_JOB_USER"
echo "known_hosts: $KEY_LINE"
