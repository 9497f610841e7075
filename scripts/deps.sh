#!/bin/sh
# Installs the Debian 12 packages libbico's build, tests and demo need.
# As root it runs apt-get; otherwise it prints the one line to run.
set -e
PKGS="build-essential pkg-config pandoc libblis-dev liblapack-dev gfortran libgtest-dev \
python3 python3-numpy python3-pytest python3-pytest-xdist python3-hypothesis python3-venv python3-torch dataset-fashion-mnist zlib1g-dev libyaml-dev \
libopenmpi-dev openmpi-bin time valgrind clang libclang-rt-14-dev abigail-tools"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "deps: all packages present"
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  echo "deps: installing:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
else
  echo "deps: missing packages; run as root:"
  echo "  apt-get update && apt-get install -y$missing"
  exit 1
fi
