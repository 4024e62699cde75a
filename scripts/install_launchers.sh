#!/usr/bin/env bash
# Installs the Debian programs tests/launched/test_launchers.py runs for real (once; a no-op when present):
# sshd + pdsh, OpenMPI, MPICH, Slurm + munge. Needs root or sudo.
#   bash scripts/install_launchers.sh
set -euo pipefail
PROGRAMS=(/usr/sbin/sshd /usr/bin/ssh /usr/bin/pdsh /usr/bin/mpirun.openmpi /usr/bin/ompi_info /usr/bin/mpirun.mpich
          /usr/bin/srun /usr/bin/sinfo /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged)
for program in "${PROGRAMS[@]}"; do
  if [ ! -x "$program" ]; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    echo "deepspeed_xla: installing sshd, pdsh, OpenMPI, MPICH and Slurm ($program is missing)" >&2
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
      openssh-server openssh-client pdsh openmpi-bin libopenmpi-dev mpich slurm-wlm munge >/dev/null
    break
  fi
done
