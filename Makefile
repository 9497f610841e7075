# libbico build.  `make` builds the shared and static library, the `bico`
# tool and the examples; `make check` runs every test; `make install`
# honours PREFIX, DESTDIR, LIBDIR, INCLUDEDIR, BINDIR, PKGCONFIGDIR, MANDIR
# and DOCDIR (the API guide and the example programs).

VERSION_MAJOR := $(shell sed -n 's/^\#define BICO_VERSION_MAJOR \([0-9]*\)/\1/p' include/bico/version.h)
VERSION_MINOR := $(shell sed -n 's/^\#define BICO_VERSION_MINOR \([0-9]*\)/\1/p' include/bico/version.h)
VERSION_PATCH := $(shell sed -n 's/^\#define BICO_VERSION_PATCH \([0-9]*\)/\1/p' include/bico/version.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)

PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
BINDIR ?= $(PREFIX)/bin
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
MANDIR ?= $(PREFIX)/share/man
DOCDIR ?= $(PREFIX)/share/doc/libbico
DESTDIR ?=

CC ?= cc
CXX ?= c++
PKG_CONFIG ?= pkg-config
BLIS_CFLAGS ?= -I/usr/include/x86_64-linux-gnu
LAPACK_LIBS ?= -llapack
BLIS_LIBS ?= -lblis

# The sanitized tree (SANITIZE=1) is built at -O1, as AddressSanitizer's
# documentation advises: the same reports, and it compiles in half the time.
OPT ?= $(if $(filter 1,$(SANITIZE)),-O1 -g,-O2 -g)
WARN := -Wall -Wextra
CFLAGS_ALL := -std=c99 -D_POSIX_C_SOURCE=200809L $(OPT) $(WARN) -fPIC \
              -fvisibility=hidden -Iinclude $(BLIS_CFLAGS) $(CFLAGS)
CXXFLAGS_ALL := -std=c++17 $(OPT) $(WARN) -Iinclude $(CXXFLAGS)

# SANITIZE=1: the same build with AddressSanitizer and UBSan, in its own tree.
ifeq ($(SANITIZE),1)
BUILD ?= build/san
SAN := -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer \
       -fno-sanitize-recover=undefined,float-cast-overflow
CFLAGS_ALL += $(SAN)
CXXFLAGS_ALL += $(SAN)
LDSAN := $(SAN)
else
BUILD ?= build
LDSAN :=
endif

# lib/ is one folder per layer (lib/README.md says what each owns and may
# call); the internal headers are included by bare name from every folder.
LIB_SRCS := $(wildcard lib/*/*.c)
LIB_OBJS := $(patsubst lib/%.c,$(BUILD)/obj/lib/%.o,$(LIB_SRCS))
LIB_DIRS := $(sort $(patsubst %/,%,$(dir $(LIB_SRCS))))
LIB_INC := $(addprefix -I,$(LIB_DIRS))
LIB_DEPS := $(wildcard include/bico/*.h) $(wildcard lib/*/*.h)
LIBS_PRIVATE := $(LAPACK_LIBS) $(BLIS_LIBS) -lm -lpthread

SONAME := libbico.so.$(VERSION_MAJOR)
SHLIB := $(BUILD)/lib/libbico.so.$(VERSION)
STLIB := $(BUILD)/lib/libbico.a

TOOL_SRCS := $(wildcard tools/bico/*.c)
TOOL := $(if $(TOOL_SRCS),$(BUILD)/bin/bico)

MAN_SRCS := $(wildcard docs/*.1.md)
MAN_PAGES := $(patsubst docs/%.md,$(BUILD)/man/%,$(MAN_SRCS))

# One small program per handle (docs/api.md walks them), C and C++17.
EXAMPLE_SRCS := $(wildcard examples/*.c)
EXAMPLE_CXX_SRCS := $(wildcard examples/*.cpp)
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(EXAMPLE_SRCS)) \
            $(patsubst examples/%.cpp,$(BUILD)/examples/%,$(EXAMPLE_CXX_SRCS))

TEST_SRCS := $(wildcard test/*.cc)
TEST_OBJS := $(patsubst test/%.cc,$(BUILD)/obj/test/%.o,$(TEST_SRCS))
TEST_BIN := $(BUILD)/test/bico_tests
GTEST_CFLAGS := $(shell $(PKG_CONFIG) --cflags gtest 2>/dev/null)
GTEST_LIBS := $(shell $(PKG_CONFIG) --libs gtest_main 2>/dev/null || echo -lgtest_main -lgtest) -pthread

RPATH := -Wl,-rpath,$(abspath $(BUILD)/lib)

.PHONY: all lib check test install uninstall clean deps examples demo help
all: lib $(TOOL) examples

# `make help`: what each target does (the first the default)
help:
	@echo 'libbico $(VERSION): make [target] [VARIABLE=value ...]'
	@echo ''
	@echo '  all (default)   the shared and static library, the bico tool, the examples'
	@echo '  check           every test (C, Python, installed library, demo); test: the same'
	@echo '  demo            the main job end to end: a fine-tune carried between two classifiers'
	@echo '  install         library, headers, pkg-config file, tools, man pages, Python package'
	@echo '  uninstall       removes what install wrote'
	@echo '  deps            installs the Debian packages the build and tests need (root)'
	@echo '  man             the man pages (pandoc)'
	@echo '  bench           benchmarks that print figures beside the competitor'
	@echo '  fuzz            the fuzz targets under libFuzzer (clang), FUZZ_SECONDS=60'
	@echo '  abi-check       the exported ABI against abi/ (the 1.x baseline)'
	@echo '  python-api-check  the Python package'"'"'s names and signatures against abi/ (1.x)'
	@echo '  leak-check      the C tests under valgrind; tsan-check: under ThreadSanitizer'
	@echo '  clean           removes $(BUILD)'
	@echo '  dist            libbico-$(VERSION).tar.gz, the source release (distcheck: it builds,'
	@echo '                  tests and installs on its own, unpacked in a fresh folder)'
	@echo ''
	@echo '  SANITIZE=1      build and test with AddressSanitizer and UBSan (-O1)'
	@echo '  PREFIX, DESTDIR, LIBDIR, INCLUDEDIR, BINDIR, PKGCONFIGDIR, MANDIR, DOCDIR: install paths'
	@echo '  JOBS            parallel build and test jobs (default: the cores)'

lib: $(SHLIB) $(STLIB) $(BUILD)/lib/bico.pc

$(BUILD)/obj/lib/%.o: lib/%.c $(LIB_DEPS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) $(LIB_INC) -DBICO_BUILDING_LIBRARY -c $< -o $@

$(SHLIB): $(LIB_OBJS) lib/libbico.vers
	@mkdir -p $(@D)
	$(CC) -shared $(LDSAN) -Wl,-soname,$(SONAME) \
	  -Wl,--version-script=lib/libbico.vers -Wl,--no-undefined \
	  -o $@ $(LIB_OBJS) $(LIBS_PRIVATE) $(LDFLAGS)
	ln -sf libbico.so.$(VERSION) $(BUILD)/lib/$(SONAME)
	ln -sf $(SONAME) $(BUILD)/lib/libbico.so

$(STLIB): $(LIB_OBJS)
	@mkdir -p $(@D)
	rm -f $@
	ar rcs $@ $(LIB_OBJS)

# bico.pc for the build tree's own use (check) is generated at install time
# from bico.pc.in with the real paths; this copy points at PREFIX.
$(BUILD)/lib/bico.pc: bico.pc.in include/bico/version.h
	@mkdir -p $(@D)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	    -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

# The build tree's bico finds build/lib through $$ORIGIN/../lib; `make
# install` links its own copy whose RUNPATH is $(LIBDIR) alone, so an
# installed program never reaches into the source tree.
# The commands' --help texts: generated from the manual (docs/bico.1.md).
HELP_H := $(BUILD)/gen/bico_help.h
$(HELP_H): docs/bico.1.md scripts/gen-help.py
	@mkdir -p $(@D)
	$(PYTHON) scripts/gen-help.py $< $@
TOOL_LINK = $(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) -I$(BUILD)/gen -o $@ $(TOOL_SRCS) \
	  -L$(BUILD)/lib -lbico $(BLIS_LIBS) -lyaml $(LDSAN) -lm $(LDFLAGS)
$(BUILD)/bin/bico: $(TOOL_SRCS) $(wildcard tools/bico/*.h) $(SHLIB) $(HELP_H)
	@mkdir -p $(@D)
	$(TOOL_LINK) -Wl,-rpath,'$$ORIGIN/../lib'
$(BUILD)/inst/bin/bico: $(TOOL_SRCS) $(wildcard tools/bico/*.h) $(SHLIB) $(HELP_H) FORCE
	@mkdir -p $(@D)
	$(TOOL_LINK) -Wl,-rpath,$(LIBDIR)
.PHONY: FORCE
FORCE:

examples: $(EXAMPLES)
$(BUILD)/examples/%: examples/%.c $(SHLIB)
	@mkdir -p $(@D)
	$(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) -o $@ $< \
	  -L$(BUILD)/lib -lbico $(RPATH) $(LDSAN) $(BLIS_LIBS) -lm -pthread $(LDFLAGS)
# The C++ wrapper (include/bico/bico.hpp) warning-free as C++17.
$(BUILD)/examples/%: examples/%.cpp include/bico/bico.hpp $(SHLIB)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS_ALL) -Werror -o $@ $< -L$(BUILD)/lib -lbico $(RPATH) \
	  $(LDSAN) $(LDFLAGS)

$(BUILD)/obj/test/%.o: test/%.cc $(wildcard test/*.h) $(LIB_DEPS)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS_ALL) $(GTEST_CFLAGS) -c $< -o $@

$(TEST_BIN): $(TEST_OBJS) $(SHLIB)
	@mkdir -p $(@D)
	$(CXX) $(LDSAN) -o $@ $(TEST_OBJS) -L$(BUILD)/lib -lbico $(RPATH) \
	  $(GTEST_LIBS) $(LAPACK_LIBS) $(BLIS_LIBS) -lm $(LDFLAGS)

# The installed-library check: install into a staging prefix, then build an
# example with nothing but pkg-config, dynamically and statically, and run it.
STAGE := $(abspath $(BUILD)/stage)
check-pkgconfig: all
	rm -rf $(STAGE)
	$(MAKE) --no-print-directory install PREFIX=$(STAGE) BUILD=$(BUILD) SANITIZE=$(SANITIZE) >/dev/null
	PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig sh -c '$(CC) $(LDSAN) -o $(BUILD)/stage/hello examples/hello.c $$($(PKG_CONFIG) --cflags --libs bico)'
	LD_LIBRARY_PATH=$(STAGE)/lib $(BUILD)/stage/hello
	PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig sh -c '$(CC) $(LDSAN) -o $(BUILD)/stage/hello-static examples/hello.c $$($(PKG_CONFIG) --cflags bico) -L$(STAGE)/lib -Wl,-Bstatic -lbico -Wl,-Bdynamic $$($(PKG_CONFIG) --static --libs bico | sed "s/-lbico//")'
	! ldd $(BUILD)/stage/hello-static | grep -q libbico
	$(BUILD)/stage/hello-static
	@# A fully static program: every private library named by --static.
	$(if $(LDSAN),,PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig sh -c '$(CC) -static -o $(BUILD)/stage/hello-allstatic examples/hello.c $$($(PKG_CONFIG) --cflags bico) $$($(PKG_CONFIG) --static --libs bico)' 2>$(BUILD)/stage/allstatic.log || { cat $(BUILD)/stage/allstatic.log; exit 1; })
	$(if $(LDSAN),,$(BUILD)/stage/hello-allstatic >/dev/null)
	test -z "$$(nm -D --defined-only $(SHLIB) | awk '{print $$3}' | grep -v '^bico_' | grep -v '^BICO_')"
	@if [ -n "$(TOOL)" ]; then rp=$$(readelf -d $(STAGE)/bin/bico | sed -n 's/.*R.*PATH.*\[\(.*\)\]/\1/p'); \
	  echo "installed bico RUNPATH: $$rp"; \
	  case ":$$rp:" in *:$(abspath $(BUILD))/lib:*|*ORIGIN*) echo "check-pkgconfig: installed bico reaches into the source tree"; exit 1;; esac; \
	  test "$$rp" = "$(STAGE)/lib"; \
	  env -u LD_LIBRARY_PATH $(STAGE)/bin/bico --version; fi
	@# the same for an installed bico-mpi (MPI=1)
	@if [ -e $(STAGE)/bin/bico-mpi ]; then rp=$$(readelf -d $(STAGE)/bin/bico-mpi | sed -n 's/.*R.*PATH.*\[\(.*\)\]/\1/p'); \
	  echo "installed bico-mpi RUNPATH: $$rp"; \
	  case ":$$rp:" in *:$(abspath $(BUILD))/lib:*|*ORIGIN*) echo "check-pkgconfig: installed bico-mpi reaches into the source tree"; exit 1;; esac; \
	  test "$$rp" = "$(STAGE)/lib"; fi
	MANPATH=$(STAGE)/share/man man -w bico | grep -q '^$(STAGE)/share/man/man1/bico.1'
	MANPATH=$(STAGE)/share/man man bico 2>/dev/null | grep -q 'carry a fine-tuning'
	test -f $(STAGE)/share/doc/libbico/api.md && test -f $(STAGE)/include/bico/bico.hpp
	@for e in $(EXAMPLE_SRCS) $(EXAMPLE_CXX_SRCS); do \
	  test -f $(STAGE)/share/doc/libbico/$$e || { echo "check-pkgconfig: $$e is not installed"; exit 1; }; done
	@echo "check-pkgconfig: installed library builds and runs through pkg-config (shared and static); only bico_* exported"

# Every example program built from the installed headers and library
# alone (pkg-config, warnings as errors; the C++ one as C++17), run, and its
# planted answer checked: each checks its own result, exits 0 and ends
# with "<name>: ok".
EXAMPLE_STAGE := $(BUILD)/stage/examples
check-examples: check-pkgconfig
	@mkdir -p $(EXAMPLE_STAGE)
	@set -e; for src in $(EXAMPLE_SRCS) $(EXAMPLE_CXX_SRCS); do \
	  name=$$(basename $${src%.*}); bin=$(EXAMPLE_STAGE)/$$name; \
	  case $$src in \
	    *.cpp) PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig sh -c '$(CXX) -std=c++17 -Wall -Wextra -Werror $(LDSAN) -o '$$bin' '$$src' $$($(PKG_CONFIG) --cflags --libs bico)';; \
	    *) PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig sh -c '$(CC) -std=c99 -Wall -Wextra -Werror $(LDSAN) -o '$$bin' '$$src' $$($(PKG_CONFIG) --cflags --libs bico) -lm -pthread';; \
	  esac; \
	  LD_LIBRARY_PATH=$(STAGE)/lib $$bin > $$bin.out 2>&1 || { cat $$bin.out; echo "check-examples: $$name failed"; exit 1; }; \
	  tail -n 1 $$bin.out | grep -qx "$$name: ok" || { cat $$bin.out; echo "check-examples: $$name did not end with '$$name: ok'"; exit 1; }; \
	  echo "check-examples: $$name: ok"; \
	done
.PHONY: check-examples

# Under the sanitizers, the Python tests that drive the (sanitized)
# programs run here; the binding's own tests (which load the library into
# the interpreter through ctypes) run in check-python-asan, with the ASan
# runtime preloaded.
ifeq ($(SANITIZE),1)
PYTEST_FILES = $(filter-out test/python/test_binding%,$(shell grep -L -E '^ *(import bico|from bico)|importorskip."bico' test/python/test_*.py))
else
PYTEST_FILES = test/python
endif

# `make check`: its whole list of prerequisites is in one place, at the end
# of this file ("---- make check ----"), after every piece is defined.
test: check

PYTHON ?= /usr/bin/python3

install: lib $(TOOL) $(if $(TOOL),$(BUILD)/inst/bin/bico) $(MAN_PAGES)
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR)/bico $(DESTDIR)$(PKGCONFIGDIR)
	install -m 644 include/bico/*.h include/bico/*.hpp $(DESTDIR)$(INCLUDEDIR)/bico/
	install -m 755 $(SHLIB) $(DESTDIR)$(LIBDIR)/
	ln -sf libbico.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libbico.so
	install -m 644 $(STLIB) $(DESTDIR)$(LIBDIR)/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	    -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g' \
	    bico.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/bico.pc
	$(if $(TOOL),install -d $(DESTDIR)$(BINDIR) && install -m 755 $(BUILD)/inst/bin/bico $(DESTDIR)$(BINDIR)/bico)
	install -d $(DESTDIR)$(MANDIR)/man1
	install -m 644 $(MAN_PAGES) $(DESTDIR)$(MANDIR)/man1/
	install -d $(DESTDIR)$(DOCDIR)/examples
	install -m 644 docs/api.md $(DESTDIR)$(DOCDIR)/
	install -m 644 $(EXAMPLE_SRCS) $(EXAMPLE_CXX_SRCS) $(DESTDIR)$(DOCDIR)/examples/

# Manual pages, generated from their Markdown source (docs/*.1.md): one
# text for the installed `man bico` and the docs folder.
PANDOC ?= pandoc
$(BUILD)/man/%.1: docs/%.1.md include/bico/version.h
	@mkdir -p $(@D)
	$(PANDOC) -s -t man --shift-heading-level-by=-1 -M section=1 \
	  -M header="libbico manual" -M footer="libbico $(VERSION)" $< -o $@.tmp
	mv $@.tmp $@
man: $(MAN_PAGES)
.PHONY: man

uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/libbico.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME) \
	      $(DESTDIR)$(LIBDIR)/libbico.so $(DESTDIR)$(LIBDIR)/libbico.a \
	      $(DESTDIR)$(PKGCONFIGDIR)/bico.pc $(DESTDIR)$(BINDIR)/bico \
	      $(patsubst $(BUILD)/man/%,$(DESTDIR)$(MANDIR)/man1/%,$(MAN_PAGES))
	rm -rf $(DESTDIR)$(INCLUDEDIR)/bico $(DESTDIR)$(DOCDIR)

deps:
	sh scripts/deps.sh

clean:
	rm -rf build

# The source release: libbico-$(VERSION).tar.gz of the tracked files (a
# MANIFEST in it lists them), reproducible.  distcheck, autotools' model:
# the archive unpacked in a fresh folder builds, passes the C tests and
# the installed-library checks, installs under DESTDIR, and makes the
# same archive again.
DIST := $(BUILD)/dist/libbico-$(VERSION).tar.gz
.PHONY: dist distcheck
dist:
	sh scripts/dist.sh $(VERSION) .
distcheck:
	sh scripts/dist.sh $(VERSION) $(BUILD)/dist
	rm -rf $(BUILD)/distcheck && mkdir -p $(BUILD)/distcheck
	tar -xzf $(DIST) -C $(BUILD)/distcheck
	cd $(BUILD)/distcheck/libbico-$(VERSION) && \
	  test ! -e .git && \
	  $(MAKE) --no-print-directory -j$(JOBS) all $(TEST_BIN) && \
	  sh scripts/gtest-shards.sh $(TEST_BIN) $(JOBS) && \
	  $(MAKE) --no-print-directory check-pkgconfig check-examples && \
	  $(MAKE) --no-print-directory install DESTDIR=$(abspath $(BUILD))/distcheck/inst PREFIX=/usr/local >/dev/null && \
	  test -f $(abspath $(BUILD))/distcheck/inst/usr/local/include/bico/bico.h && \
	  sh scripts/dist.sh $(VERSION) ../again >/dev/null && \
	  cmp $(abspath $(DIST)) ../again/libbico-$(VERSION).tar.gz
	@echo "distcheck: $(DIST) builds, tests, installs and makes itself again"

# ---- safetensors/JSON interop helpers (test/st_tool.c, test/json_tool.c) ----
# A small driver of the safetensors API that the Python interop tests
# (test/python/test_safetensors_interop.py) run; built with the test binary.
ST_TOOL := $(BUILD)/test/st_tool
$(ST_TOOL): test/st_tool.c $(SHLIB)
	@mkdir -p $(@D)
	$(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) -o $@ $< \
	  -L$(BUILD)/lib -lbico $(RPATH) $(LDSAN) $(LDFLAGS)
# The internal JSON reader/writer driven from Python
# (test/python/test_json_interop.py): links the static library, where the
# internal symbols are visible.
JSON_TOOL := $(BUILD)/test/json_tool
$(JSON_TOOL): test/json_tool.c lib/base/json.h $(STLIB)
	@mkdir -p $(@D)
	$(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) $(LIB_INC) -o $@ $< \
	  $(STLIB) $(LDSAN) $(LAPACK_LIBS) $(BLIS_LIBS) -lm -lpthread $(LDFLAGS)
$(TEST_BIN): | $(ST_TOOL) $(JSON_TOOL)

# ---- python ----
# The ctypes binding (bindings/python/bico) installs as a plain package into
# PYTHONDIR; it finds the library through $BICO_LIBRARY, then the LIBDIR
# recorded here at install time, then paths relative to the package.
# Asked of the interpreter (scripts/pythondir.py): a folder on its sys.path
# for /usr/local and /usr on Debian, PREFIX/lib/python3.X/site-packages else.
PYTHONDIR ?= $(shell $(PYTHON) scripts/pythondir.py $(PREFIX))
PY_SRCS := $(wildcard bindings/python/bico/*.py)
# the sub-packages (bico.torch, bico.llm): folders with an __init__.py
PY_SUBPKGS := $(patsubst bindings/python/bico/%/__init__.py,%,$(wildcard bindings/python/bico/*/__init__.py) $(wildcard bindings/python/bico/*/*/__init__.py))

.PHONY: install-python uninstall-python check-python-install
install: install-python
uninstall: uninstall-python
# Python loads the library through ctypes: not under the sanitizers
# (make check runs check-python-install only in a plain build).

# bico-llm: `python3 -m bico.llm` as a command whose interpreter is
# $(PYTHON) (its absolute path in the shebang), on the package installed
# here (scripts/bico-llm.in).
PYTHON_ABS = $(shell $(PYTHON) -c 'import sys; print(sys.executable)')

install-python:
	install -d $(DESTDIR)$(BINDIR)
	sed -e 's|@PYTHON@|$(PYTHON_ABS)|g' -e 's|@PYTHONDIR@|$(PYTHONDIR)|g' \
	    scripts/bico-llm.in > $(DESTDIR)$(BINDIR)/bico-llm.tmp
	chmod 755 $(DESTDIR)$(BINDIR)/bico-llm.tmp
	mv $(DESTDIR)$(BINDIR)/bico-llm.tmp $(DESTDIR)$(BINDIR)/bico-llm
	install -d $(DESTDIR)$(PYTHONDIR)/bico
	# modules removed before 1.0 (CHANGELOG.md), gone from an older install
	rm -f $(DESTDIR)$(PYTHONDIR)/bico/hf.py $(DESTDIR)$(PYTHONDIR)/bico/torch_fit.py
	install -m 644 $(filter-out %/_install.py,$(PY_SRCS)) $(DESTDIR)$(PYTHONDIR)/bico/
	# a sub-package replaces the module of its name an older install left
	for p in $(PY_SUBPKGS); do \
	  rm -f $(DESTDIR)$(PYTHONDIR)/bico/$$p.py; \
	  install -d $(DESTDIR)$(PYTHONDIR)/bico/$$p && \
	  install -m 644 bindings/python/bico/$$p/*.py $(DESTDIR)$(PYTHONDIR)/bico/$$p/ || exit 1; \
	done
	printf '# Written by make install.\nLIBDIR = %s\nPYTHON = %s\n' "'$(LIBDIR)'" "'$(PYTHON_ABS)'" > $(DESTDIR)$(PYTHONDIR)/bico/_install.py

uninstall-python:
	rm -rf $(DESTDIR)$(PYTHONDIR)/bico
	rm -f $(DESTDIR)$(BINDIR)/bico-llm

# The binding under AddressSanitizer.  A sanitized libbico loads into a
# plain interpreter only when the ASan runtime comes first in the process:
# preload it (leak detection off: the interpreter does not free everything
# at exit).  `make check SANITIZE=1` runs the binding's tests this way;
# `make check-python-asan` does it from a normal build (it builds the
# sanitized tree).
ASAN_RT = $(shell $(CC) -print-file-name=libasan.so)
PY_BINDING_TESTS = $(shell grep -l -E '^ *(import bico|from bico)|importorskip."bico' test/python/test_*.py)
.PHONY: check-python-asan
ifeq ($(SANITIZE),1)
check-python-asan: all
	env LD_PRELOAD=$(ASAN_RT) ASAN_OPTIONS=detect_leaks=0 $(PYTEST_REACH) \
	  $(PYTEST) $(PY_BINDING_TESTS)
else
check-python-asan:
	$(MAKE) --no-print-directory SANITIZE=1 check-python-asan
endif

# The installed package imports with nothing set in the environment and
# loads the installed library.
check-python-install: all
	rm -rf $(BUILD)/pystage
	$(MAKE) --no-print-directory install PREFIX=$(abspath $(BUILD)/pystage) BUILD=$(BUILD) >/dev/null
	cd / && env -u BICO_LIBRARY -u BICO_BUILD PYTHONPATH=$$($(PYTHON) $(abspath scripts/pythondir.py) $(abspath $(BUILD)/pystage)) \
	  $(PYTHON) -c 'import bico, sys; print("installed binding:", bico.__file__, "->", bico.library_path); sys.exit(not bico.library_path.startswith("$(abspath $(BUILD)/pystage)/lib/"))'
	cd / && env -u BICO_LIBRARY -u BICO_BUILD PYTHONPATH=$$($(PYTHON) $(abspath scripts/pythondir.py) $(abspath $(BUILD)/pystage)) \
	  $(PYTHON) $(abspath scripts/check-python-import.py) $(abspath bindings/python/bico) $(abspath $(BUILD)/pystage)
	@# bico-llm: its interpreter is $(PYTHON), and it runs from anywhere
	head -1 $(BUILD)/pystage/bin/bico-llm | grep -qx '#!$(PYTHON_ABS)'
	cd / && env -u BICO_LIBRARY -u BICO_BUILD -u PYTHONPATH $(abspath $(BUILD)/pystage)/bin/bico-llm --help | grep -q -- '--output-lora'
	cd / && env -u BICO_LIBRARY -u BICO_BUILD -u PYTHONPATH $(abspath $(BUILD)/pystage)/bin/bico-llm stats --help | grep -q -- '--stats'
	$(MAKE) --no-print-directory uninstall-python PREFIX=$(abspath $(BUILD)/pystage) BUILD=$(BUILD) >/dev/null
	test ! -e $(BUILD)/pystage/bin/bico-llm
	@echo "check-python-install: bico-llm runs with $(PYTHON_ABS); make uninstall removes it"
	@d=$$($(PYTHON) scripts/pythondir.py /usr/local); $(PYTHON) -c "import sys; sys.exit(0 if '$$d' in sys.path else 1)" || \
	  { echo "check-python-install: $$d (PREFIX=/usr/local) is not on $(PYTHON)'s sys.path"; exit 1; }
	@echo "check-python-install: PREFIX=/usr/local installs into $$($(PYTHON) scripts/pythondir.py /usr/local), on sys.path"

# `pip install ./bindings/python` into a fresh venv, offline (--no-index:
# the in-tree build backend needs nothing from an index), then the package
# loads the build's library.
.PHONY: check-python-pip
check-python-pip: all
	rm -rf $(BUILD)/venv
	$(PYTHON) -m venv --system-site-packages $(BUILD)/venv
	$(BUILD)/venv/bin/pip install -q --no-index --no-cache-dir ./bindings/python
	cd / && BICO_LIBRARY=$(abspath $(SHLIB)) $(abspath $(BUILD))/venv/bin/python -c \
	  'import bico, sys; print("pip-installed binding:", bico.__file__, bico.version()); sys.exit(not bico.__file__.startswith("$(abspath $(BUILD))/venv/"))'
	cd / && BICO_LIBRARY=$(abspath $(SHLIB)) $(abspath $(BUILD))/venv/bin/python \
	  $(abspath scripts/check-python-import.py) $(abspath bindings/python/bico) $(abspath $(BUILD))/venv

# ---- demo ----
# `make demo`: the main job end to end on Fashion-MNIST (examples/demo/, an
# example-local MLP trainer over BLIS; every transfer through the public API).
# `demo-test`: its small configuration, run from an empty cache, then again
# from the cache (the same table must come out), part of `make check`.
DEMO_SRCS := $(wildcard examples/demo/*.c)
DEMO_BIN := $(BUILD)/demo/bico-demo
DEMO_TEST_DIR := $(BUILD)/demo-test

$(DEMO_BIN): $(DEMO_SRCS) $(wildcard examples/demo/*.h) $(SHLIB)
	@mkdir -p $(@D)
	$(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) -o $@ $(DEMO_SRCS) \
	  -L$(BUILD)/lib -lbico $(RPATH) $(LDSAN) $(BLIS_LIBS) -lz -lm $(LDFLAGS)

# The tables are a deterministic function of the library, the demo program
# and Debian's fixed data files: a rerun with both binaries unchanged (same
# SHA-256) prints the stored tables in seconds instead of re-evaluating
# every method at every alpha (about a minute).  `make demo DEMO_FRESH=1`
# recomputes them anyway.
demo:
	sh scripts/deps.sh
	$(MAKE) --no-print-directory $(DEMO_BIN)
	@mkdir -p $(BUILD)/demo; \
	key=$$(cat $(SHLIB) $(DEMO_BIN) | sha256sum | cut -d' ' -f1); \
	if [ -z "$(DEMO_FRESH)" ] && [ -s $(BUILD)/demo/results.txt ] && \
	   [ "$$(cat $(BUILD)/demo/results.key 2>/dev/null)" = "$$key" ]; then \
	  cat $(BUILD)/demo/results.txt; \
	  echo "demo: libbico and bico-demo unchanged since the run that wrote $(BUILD)/demo/results.txt; shown from there (make demo DEMO_FRESH=1 recomputes)"; \
	else \
	  rm -f $(BUILD)/demo/results.key; \
	  $(DEMO_BIN) --out $(BUILD)/demo > $(BUILD)/demo/results.txt.part && \
	  mv $(BUILD)/demo/results.txt.part $(BUILD)/demo/results.txt && \
	  echo "$$key" > $(BUILD)/demo/results.key && cat $(BUILD)/demo/results.txt; \
	fi

.PHONY: demo-test
demo-test: $(DEMO_BIN)
	rm -rf $(DEMO_TEST_DIR)
	$(DEMO_BIN) --small --out $(DEMO_TEST_DIR) > $(DEMO_TEST_DIR).first.txt
	$(DEMO_BIN) --small --out $(DEMO_TEST_DIR) > $(DEMO_TEST_DIR).second.txt
	cmp $(DEMO_TEST_DIR).first.txt $(DEMO_TEST_DIR).second.txt
	@echo "demo-test: small configuration passed; the rerun from the cache printed the same table"


# ---- mpi ----
# `make MPI=1` also builds build/bin/bico-mpi: the bico command whose stats
# and transfer divide their work among MPI ranks (tools/bico-mpi; the
# library itself stays MPI-free).  It links the serial command's objects
# (all but its entry point, tools/bico/bico.c), so the options are the
# same, and hands the configured transfer to its own runner.
# `make check MPI=1` runs test/mpi under mpirun (2 and 3 ranks).  MPI is on
# by default where mpicc is installed (`make deps` installs it); MPI=0 turns
# it off.
MPI ?= $(if $(shell command -v mpicc 2>/dev/null),1,0)
ifeq ($(MPI),1)
MPICC ?= mpicc
MPIRUN ?= mpirun
MPI_TOOL := $(BUILD)/bin/bico-mpi
MPI_SRCS := $(wildcard tools/bico-mpi/*.c)
MPI_OBJS := $(patsubst tools/bico/%.c,$(BUILD)/obj/mpi/serial/%.o,$(filter-out tools/bico/bico.c,$(TOOL_SRCS))) \
            $(patsubst tools/bico-mpi/%.c,$(BUILD)/obj/mpi/%.o,$(MPI_SRCS))
MPI_CFLAGS := $(filter-out -fvisibility=hidden,$(CFLAGS_ALL))
all: $(MPI_TOOL)
$(BUILD)/obj/mpi/serial/%.o: tools/bico/%.c $(wildcard tools/bico/*.h) $(LIB_DEPS) $(HELP_H)
	@mkdir -p $(@D)
	$(MPICC) $(MPI_CFLAGS) -I$(BUILD)/gen -c $< -o $@
$(BUILD)/obj/mpi/%.o: tools/bico-mpi/%.c $(wildcard tools/bico-mpi/*.h) $(wildcard tools/bico/*.h) $(LIB_DEPS)
	@mkdir -p $(@D)
	$(MPICC) $(MPI_CFLAGS) -Itools/bico -c $< -o $@
MPI_LINK = $(MPICC) -o $@ $(MPI_OBJS) -L$(BUILD)/lib -lbico $(LDSAN) $(BLIS_LIBS) -lyaml -lm $(LDFLAGS)
$(MPI_TOOL): $(MPI_OBJS) $(SHLIB)
	@mkdir -p $(@D)
	$(MPI_LINK) $(RPATH)
# As for bico: the installed copy is linked again with RUNPATH $(LIBDIR)
# alone, never the build tree's library folder.
$(BUILD)/inst/bin/bico-mpi: $(MPI_OBJS) $(SHLIB) FORCE
	@mkdir -p $(@D)
	$(MPI_LINK) -Wl,-rpath,$(LIBDIR)
.PHONY: check-mpi
check-mpi: $(MPI_TOOL) $(TOOL)
	BICO_BUILD=$(abspath $(BUILD)) BICO_MPI=$(abspath $(MPI_TOOL)) MPIRUN=$(MPIRUN) \
	  ASAN_OPTIONS=detect_leaks=0 $(PYTHON) -m pytest -q test/mpi
install: install-mpi
uninstall: uninstall-mpi
.PHONY: install-mpi uninstall-mpi
install-mpi: $(MPI_TOOL) $(BUILD)/inst/bin/bico-mpi
	install -d $(DESTDIR)$(BINDIR)
	install -m 755 $(BUILD)/inst/bin/bico-mpi $(DESTDIR)$(BINDIR)/bico-mpi
uninstall-mpi:
	rm -f $(DESTDIR)$(BINDIR)/bico-mpi
# Scale-out figures (docs/scale-out.md): transfer and statistics at 1, 2 and
# 4 ranks on a synthetic model; sizes via BENCH_DA, BENCH_DB, BENCH_LA,
# BENCH_LB, BENCH_ROWS, BENCH_RANKS.
.PHONY: bench bench-mpi
bench: bench-mpi
bench-mpi: $(MPI_TOOL) $(TOOL)
	BICO_BUILD=$(abspath $(BUILD)) BICO_MPI=$(abspath $(MPI_TOOL)) MPIRUN=$(MPIRUN) \
	  $(PYTHON) test/mpi/bench.py
endif

# ---- bench ----
# `make bench`: the benchmark programs of bench/ against their PyTorch and
# NumPy twins, side by side in one run (tables only, never pass/fail).
# BENCH_FLAGS passes options to bench/run.py (e.g. --quick).
BENCH_SRCS := $(wildcard bench/*.c)
BENCH_BINS := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRCS))
# BENCH_THREADS: BLAS threads of both sides (default: every core).
BENCH_FLAGS ?=
BENCH_THREADS ?= $(shell nproc 2>/dev/null || echo 1)

.PHONY: bench bench-bins
bench-bins: $(BENCH_BINS)
$(BUILD)/bench/%: bench/%.c bench/common.h $(SHLIB)
	@mkdir -p $(@D)
	$(CC) $(filter-out -fvisibility=hidden,$(CFLAGS_ALL)) -o $@ $< \
	  -L$(BUILD)/lib -lbico $(RPATH) $(LDSAN) $(LAPACK_LIBS) $(BLIS_LIBS) -lm $(LDFLAGS)

bench: $(BENCH_BINS) $(TOOL)
	$(PYTHON) bench/run.py --bin $(BUILD)/bench --threads $(BENCH_THREADS) $(BENCH_FLAGS)
	$(MAKE) --no-print-directory bench-llm

# `make bench-llm` (run by `make bench`, after its tables): the LLM routes
# streamed a block at a time from the model folders against the in-memory
# route (docs/performance.md section 8): python3 -m bico.llm in a child under
# /usr/bin/time -v (peak resident set, wall time) at depth (4 and 16 layers,
# 512 wide), at the whole 0.5B -> 1.5B shape (bf16), one 7B-shaped block's
# cost, the arithmetic of what a run holds at 7B and 70B, and of what a run
# across processes would move (docs/scale-out.md, designed); the
# distillation's step beside a plain PyTorch loop (bench/llm_distill_step.py).  Folders are
# written once into $(LLM_BENCH_WORK) (about 13 GB) and reused.  Long: the
# in-memory 0.5B -> 1.5B run holds the whole models in float32 and more
# than 24 GB (the kernel killed it at 23.4 GB on a 24 GB machine: its line
# then says "failed (-9)").  BENCH_THREADS as for `make bench`.
LLM_BENCH_WORK ?= $(BUILD)/llm_stream
LLM_BENCH_ENV = BICO_BUILD=$(abspath $(BUILD)) PYTHONPATH=$(abspath bindings/python)
LLM_BENCH = $(LLM_BENCH_ENV) $(PYTHON) bench/llm_stream.py
.PHONY: bench-llm
bench-llm: $(SHLIB)
	$(LLM_BENCH) depth --in-memory --work $(LLM_BENCH_WORK) --threads $(BENCH_THREADS)
	$(LLM_BENCH) depth --untied --work $(LLM_BENCH_WORK) --threads $(BENCH_THREADS)
	$(LLM_BENCH) scale --in-memory --work $(LLM_BENCH_WORK) --threads $(BENCH_THREADS)
	$(LLM_BENCH) block --work $(LLM_BENCH_WORK) --threads $(BENCH_THREADS)
	$(LLM_BENCH) arith
	$(LLM_BENCH) scaleout
	$(LLM_BENCH_ENV) $(PYTHON) bench/llm_distill_step.py --threads $(BENCH_THREADS) \
	  --work $(LLM_BENCH_WORK)/distill_step

# `make bench-quality`: how much of the zero-shot -> fine-tuned gap each
# method closes on small Fashion-MNIST ViTs, over several seeds
# (docs/quality.md).  Trained models and results are cached in
# $(BUILD)/quality, results keyed by a hash of the library and binding
# sources too (a rerun prints from the cache; a code change recomputes);
# QUALITY_FLAGS passes options to bench/quality/run.py (--fresh, --seeds,
# --tasks, --replicate-tasks, --targets, --rows).  One thread, niced: a
# shared machine.
QUALITY_FLAGS ?=
.PHONY: bench-quality
bench-quality: all
	cd bench/quality && BICO_QUALITY_CACHE=$(abspath $(BUILD))/quality \
	  BICO_LIBRARY=$(abspath $(SHLIB)) OMP_NUM_THREADS=1 \
	  nice $(PYTHON) prepare.py >&2
	cd bench/quality && BICO_QUALITY_CACHE=$(abspath $(BUILD))/quality \
	  BICO_LIBRARY=$(abspath $(SHLIB)) OMP_NUM_THREADS=1 \
	  nice $(PYTHON) run.py $(QUALITY_FLAGS)
	cd bench/quality_llm && BICO_LLM_CACHE=$(abspath $(BUILD))/quality-llm BICO_CLI=$(abspath $(BUILD))/bin/bico \
	  BICO_LIBRARY=$(abspath $(SHLIB)) OMP_NUM_THREADS=1 nice $(PYTHON) run.py $(QUALITY_LLM_FLAGS)

# ---- robustness ----
# Fuzzing, the ABI gate, header hygiene, leak and thread checking, and the
# no-data-lost test of the command (docs/reliability.md).
.PHONY: fuzz fuzz-build abi-check abi-baseline abi-dump python-api-check python-api-baseline header-check leak-check check-robust tsan-check

# make fuzz FUZZ_SECONDS=N: each libFuzzer target in test/fuzz/ runs N seconds
# over a copy of its seed corpus (new inputs and crash files go to
# build/fuzz/<target>/); any crash fails.  The library's sources are compiled
# straight into each fuzzer, so targets may use internal headers.
FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang
FUZZ_SAN := -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
            -fno-omit-frame-pointer
FUZZ_TARGETS := $(patsubst test/fuzz/%.c,%,$(wildcard test/fuzz/fuzz_*.c))
FUZZ_BINS := $(patsubst %,build/fuzz/bin/%,$(FUZZ_TARGETS))

FUZZ_CFLAGS := -std=c99 -D_POSIX_C_SOURCE=200809L -g -O1 -Iinclude $(LIB_INC) $(BLIS_CFLAGS)
FUZZ_OBJS := $(patsubst lib/%.c,build/fuzz/obj/%.o,$(LIB_SRCS))

# The library's objects once, instrumented for every target.
$(FUZZ_OBJS): build/fuzz/obj/%.o: lib/%.c $(LIB_DEPS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(subst fuzzer,fuzzer-no-link,$(FUZZ_SAN)) -c $< -o $@

$(FUZZ_BINS): build/fuzz/bin/%: test/fuzz/%.c $(wildcard test/fuzz/*.h) $(FUZZ_OBJS)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_SAN) -o $@ $< $(FUZZ_OBJS) \
	  $(LAPACK_LIBS) $(BLIS_LIBS) -lm -lpthread

fuzz-build: $(FUZZ_BINS)

fuzz:
	$(MAKE) --no-print-directory -j$(JOBS) fuzz-build
	sh scripts/fuzz.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# make abi-check: the library's ABI (abidw, public types only) against the
# committed baseline (the experimental section is exempt:
# abi/experimental.suppr).  Fails on anything abidiff reports besides added
# symbols and harmless enumerator additions: removals (status bit 8) and
# changed signatures, types or enumerator values (bit 4; abidiff does not
# count a changed pointee type as "incompatible", but callers break).  The
# library is built with -g in its own tree so that the result does not
# depend on the caller's flags.
ABI_BUILD := build/abi
ABI_LIB := $(ABI_BUILD)/lib/libbico.so.$(VERSION)
ABI_BASELINE := abi/libbico.so.$(VERSION_MAJOR).abi
ABIDW_FLAGS := --no-corpus-path --no-comp-dir-path --no-show-locs \
               --no-elf-needed --type-id-style hash --exported-interfaces-only \
               --headers-dir include/bico --drop-private-types

# Recipes, not rules, build the library there: a rule for $(ABI_LIB) would
# also match the sub-make's own $(SHLIB) and recurse.
abi-dump:
	$(MAKE) --no-print-directory -j$(JOBS) BUILD=$(ABI_BUILD) SANITIZE= OPT='-O2 -g' lib
	abidw $(ABIDW_FLAGS) --out-file $(ABI_BUILD)/libbico.abi $(ABI_LIB)

abi-baseline: abi-dump
	@mkdir -p abi
	cp $(ABI_BUILD)/libbico.abi $(ABI_BASELINE)
	@echo "abi-baseline: wrote $(ABI_BASELINE); commit it"

abi-check: abi-dump
	@test -f $(ABI_BASELINE) || { echo "abi-check: no baseline $(ABI_BASELINE) (make abi-baseline)"; exit 1; }
	@rc=0; abidiff --no-show-locs --no-added-syms --suppressions abi/experimental.suppr $(ABI_BASELINE) $(ABI_BUILD)/libbico.abi || rc=$$?; \
	if [ $$rc -ne 0 ]; then \
	  echo "abi-check: FAILED (abidiff status $$rc; 8 = incompatible, 4 = changed function or type): see above"; exit 1; fi; \
	rc=0; abidiff --no-show-locs --suppressions abi/experimental.suppr $(ABI_BASELINE) $(ABI_BUILD)/libbico.abi >$(ABI_BUILD)/additions.txt || rc=$$?; \
	if [ $$rc -ne 0 ]; then cat $(ABI_BUILD)/additions.txt; \
	  echo "abi-check: additions only (each needs a version-script node and a CHANGELOG line)"; \
	else echo "abi-check: ABI identical to $(ABI_BASELINE)"; fi

# make python-api-check: the Python package's public names and signatures
# against the frozen listing (abi/python-$(VERSION_MAJOR).txt; the rule:
# scripts/python-api.py); make python-api-baseline rewrites it.  make check
# runs the same comparison (test/python/test_python_api.py).
PY_API_BASELINE := abi/python-$(VERSION_MAJOR).txt
python-api-check: $(SHLIB)
	PYTHONPATH=bindings/python BICO_LIBRARY=$(CURDIR)/$(SHLIB) $(PYTHON) scripts/python-api.py --check $(PY_API_BASELINE)

python-api-baseline: $(SHLIB)
	PYTHONPATH=bindings/python BICO_LIBRARY=$(CURDIR)/$(SHLIB) $(PYTHON) scripts/python-api.py > $(PY_API_BASELINE).tmp
	mv $(PY_API_BASELINE).tmp $(PY_API_BASELINE)
	@echo "python-api-baseline: wrote $(PY_API_BASELINE); commit it"

# make header-check: every public header alone as C99 and C++11 (pedantic,
# -Werror), with $(CC)/$(CXX) and with clang when present; exports bico_* only.
header-check: $(SHLIB)
	sh scripts/header-check.sh $(SHLIB) '$(CC)' '$(CXX)'
	@if command -v clang >/dev/null 2>&1 && [ "$(CC)" != clang ]; then \
	  sh scripts/header-check.sh $(SHLIB) clang clang++; fi

# make leak-check: the GoogleTest suite under valgrind memcheck; a definite
# leak or any memory error fails.  Suppressions (third-party frames only)
# are in test/valgrind.supp.  LEAK_FILTER narrows the suite.
LEAK_FILTER ?= *
VALGRIND ?= valgrind
leak-check:
	@if [ "$(SANITIZE)" = 1 ]; then echo "leak-check: run without SANITIZE=1"; exit 1; fi
	$(MAKE) --no-print-directory -j$(JOBS) $(TEST_BIN)
	WRAP="$(VALGRIND) --tool=memcheck --leak-check=full --errors-for-leak-kinds=definite \
	  --error-exitcode=1 --suppressions=$(abspath test/valgrind.supp) --num-callers=30" \
	  LOGDIR=$(BUILD)/leak-check sh scripts/gtest-shards.sh $(TEST_BIN) $(JOBS) \
	  --gtest_filter='$(LEAK_FILTER)'

# make tsan-check: the thread tests under ThreadSanitizer (library and tests
# built with -fsanitize=thread in build/tsan).  BLIS and libgomp are not
# instrumented; test/tsan.supp names what of theirs is suppressed and why.
TSAN_FILTER ?= RobustThreads.*:Planted.TwoContexts*:TransferPipeline.*
tsan-check:
	$(MAKE) --no-print-directory -j$(JOBS) BUILD=build/tsan SANITIZE= OPT='-O1 -g' \
	  CFLAGS=-fsanitize=thread CXXFLAGS=-fsanitize=thread LDFLAGS=-fsanitize=thread \
	  build/tsan/test/bico_tests
	TSAN_OPTIONS="halt_on_error=1 exitcode=66 suppressions=$(abspath test/tsan.supp)" \
	  build/tsan/test/bico_tests --gtest_filter='$(TSAN_FILTER)'

# make check-robust: nothing on disk is lost when `bico transfer` is killed
# (SIGKILL at random moments), hits a file-size limit or meets a read-only
# folder; inputs are opened read-only (test/robust/no_data_lost.py).
ROBUST_KILLS ?= 12
check-robust: $(TOOL)
	@if [ -n "$(TOOL)" ]; then $(PYTHON) test/robust/no_data_lost.py $(TOOL) $(ROBUST_KILLS); \
	else echo "check-robust: no bico command in this tree; skipped"; fi

# make check-layers: lib/'s house (lib/README.md): no cycle among its files,
# no call from a folder to one of its own or a higher layer, none up into
# the command; read from the object files' symbols.
.PHONY: check-layers
check-layers: $(LIB_OBJS) $(TOOL)
	$(PYTHON) scripts/check-layers.py $(BUILD)/obj/lib $(TOOL)

# ---- make check ----
# `make check` runs its stages one after the other, each timed by
# scripts/stage.sh; the table of stage times comes at the end, and a
# stage that fails ends the run with the table so far and the failing
# tests named last.  JOBS (default: the CPUs) is how many compilers, test
# shards and pytest workers run at once.
#   build           library, command, examples, tests (-j$(JOBS))
#   c-tests         the GoogleTest suite in $(JOBS) shards
#                   (scripts/gtest-shards.sh), its slowest tests listed
#   installed       the installed library (pkg-config) and the example
#                   programs built and run against it; the Python binding
#                   installed and pip-installed (plain build), or the
#                   binding's tests under AddressSanitizer (SANITIZE=1)
#   demo-test, mpi  the demo's small configuration; the MPI command (MPI=1)
#   headers         every public header alone, the library's layers (plain
#                   build: neither runs code, so a sanitized tree adds
#                   nothing to them)
#   robust          nothing on disk is lost (check-robust)
#   python-tests    the pytest suite on $(JOBS) workers (pytest-xdist, by
#                   file), its slowest ten tests listed.  The plain run
#                   records which tests reach the C library
#                   (test/python/conftest.py); with SANITIZE=1 only those
#                   run again, against the sanitized library and programs.
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
STAGES = sh scripts/stage.sh
CHECK_LOG = $(BUILD)/check
# The record of the tests that reach C: written by the plain run, read by
# the sanitized one (a record of other Python sources, or none: all run).
REACH_RECORD := $(abspath build)/python-reach-c.txt
XDIST = $(if $(shell [ "$(JOBS)" -gt 1 ] 2>/dev/null && $(PYTHON) -c 'import xdist' 2>/dev/null && echo yes),-n $(JOBS) --dist loadfile)
# (each worker one thread of its own: JOBS workers, JOBS cores)
PYTEST = $(if $(XDIST),OMP_NUM_THREADS=1) \
  PYTHONPATH=$(abspath bindings/python) BICO_BUILD=$(abspath $(BUILD)) \
  BICO_LIBRARY=$(abspath $(SHLIB)) $(PYTHON) -m pytest -q -p no:cacheprovider \
  --durations=10 $(XDIST)
ifeq ($(SANITIZE),1)
PYTEST_REACH = BICO_REACH_ONLY=$(REACH_RECORD)
else
PYTEST_REACH = BICO_REACH_RECORD=$(REACH_RECORD)
endif
check:
	@$(STAGES) begin $(CHECK_LOG)
	@$(STAGES) run $(CHECK_LOG) build $(MAKE) --no-print-directory -j$(JOBS) all $(TEST_BIN)
	@$(STAGES) run $(CHECK_LOG) c-tests sh scripts/gtest-shards.sh $(TEST_BIN) $(JOBS)
	@$(STAGES) run $(CHECK_LOG) installed $(MAKE) --no-print-directory check-pkgconfig check-examples
ifeq ($(SANITIZE),1)
	@$(STAGES) run $(CHECK_LOG) python-asan $(MAKE) --no-print-directory check-python-asan
else
	@$(STAGES) run $(CHECK_LOG) python-install $(MAKE) --no-print-directory check-python-install check-python-pip
endif
	@$(STAGES) run $(CHECK_LOG) demo-test $(MAKE) --no-print-directory demo-test
ifeq ($(MPI),1)
	@$(STAGES) run $(CHECK_LOG) mpi $(MAKE) --no-print-directory check-mpi
endif
ifneq ($(SANITIZE),1)
	@$(STAGES) run $(CHECK_LOG) headers $(MAKE) --no-print-directory header-check check-layers
endif
	@$(STAGES) run $(CHECK_LOG) robust $(MAKE) --no-print-directory check-robust
	@$(STAGES) run $(CHECK_LOG) python-tests env $(PYTEST_REACH) $(PYTEST) $(PYTEST_FILES)
	@$(STAGES) report $(CHECK_LOG) "make check$(if $(filter 1,$(SANITIZE)), SANITIZE=1)"
