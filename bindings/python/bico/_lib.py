"""Finds libbico and declares the C prototypes (ctypes).

Search order (the first that loads wins; bico.library_path says which):
  1. $BICO_LIBRARY (a file path);
  2. the install prefix: the LIBDIR that `make install` recorded in
     bico/_install.py, then paths relative to this package: an installed
     package lives
     in <prefix>/lib/python3/dist-packages/bico (or
     <prefix>/lib/python3.X/site-packages/bico), the library in <prefix>/lib;
  3. the build tree of a source checkout: <repo>/build/lib (this file is
     <repo>/bindings/python/bico/_lib.py), or $BICO_BUILD/lib;
  4. the dynamic loader's own search by soname (libbico.so.1, also through
     ctypes.util.find_library("bico")).
When nothing loads, ImportError lists every place tried and why it failed.
"""
import ctypes
import ctypes.util
import os

SONAME = "libbico.so.1"

_here = os.path.dirname(os.path.abspath(__file__))

c_size_t = ctypes.c_size_t
c_int = ctypes.c_int
c_uint = ctypes.c_uint
c_long = ctypes.c_long
c_float = ctypes.c_float
c_double = ctypes.c_double
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
P = ctypes.POINTER
PP = P(c_void_p)  # handle out-pointer


def _candidates():
    """(path, why) pairs in search order."""
    out = []
    env = os.environ.get("BICO_LIBRARY")
    if env:
        out.append((env, "$BICO_LIBRARY"))
    try:
        from ._install import LIBDIR  # written by make install
        out.append((os.path.join(LIBDIR, SONAME), "install prefix (LIBDIR)"))
    except ImportError:
        pass
    # <prefix>/lib/python3/dist-packages/bico -> <prefix>/lib
    libdir = os.path.normpath(os.path.join(_here, "..", "..", ".."))
    out.append((os.path.join(libdir, SONAME), "install prefix"))
    # <prefix>/lib/python3.X/site-packages/bico and lib64 variants share it;
    # Debian's multiarch libdir sits next to it.
    out.append((os.path.join(libdir, "x86_64-linux-gnu", SONAME),
                "install prefix (multiarch)"))
    build = os.environ.get("BICO_BUILD")
    if build:
        out.append((os.path.join(build, "lib", SONAME), "$BICO_BUILD"))
    repo = os.path.normpath(os.path.join(_here, "..", "..", ".."))
    out.append((os.path.join(repo, "build", "lib", SONAME), "build tree"))
    out.append((SONAME, "soname via the dynamic loader"))
    found = ctypes.util.find_library("bico")
    if found and found != SONAME:
        out.append((found, "ctypes.util.find_library('bico')"))
    return out


def _load():
    tried = []
    seen = set()
    for path, why in _candidates():
        if path in seen:
            continue
        seen.add(path)
        if os.sep in path and not os.path.exists(path):
            tried.append("  %s (%s): no such file" % (path, why))
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append("  %s (%s): %s" % (path, why, e))
            continue
        return lib, (os.path.realpath(path) if os.sep in path else
                     _loaded_path(path)), why
    raise ImportError("bico: could not load libbico (%s); tried:\n%s\n"
                      "Set BICO_LIBRARY to the library file, or install it "
                      "(make install)." % (SONAME, "\n".join(tried)))


def _loaded_path(name):
    """The file the loader picked for a bare soname (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libbico.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return name


lib, library_path, library_source = _load()

# name: (restype, argtypes).  Status-returning functions return c_int.
_S = c_int
PROTOTYPES = {
    # status, version
    "bico_strerror": (c_char_p, [c_int]),
    "bico_version_string": (c_char_p, []),
    "bico_version_number": (c_uint, []),
    # ctx
    "bico_ctx_create": (_S, [PP]),
    # (declared for completeness; Python callbacks as allocators would run
    # under the GIL for every allocation, so Context does not offer it)
    "bico_ctx_create_with_allocator": (_S, [PP, c_void_p, c_void_p,
                                            c_void_p]),
    "bico_ctx_free": (None, [c_void_p]),
    "bico_ctx_set_param": (_S, [c_void_p, c_int, c_double]),
    "bico_ctx_get_param": (_S, [c_void_p, c_int, P(c_double)]),
    "bico_ctx_param_bounds": (_S, [c_int, P(c_double), P(c_double), P(c_uint)]),
    "bico_ctx_errmsg": (c_char_p, [c_void_p]),
    "bico_ctx_errcode": (_S, [c_void_p]),
    "bico_status_name": (c_char_p, [c_int]),
    "bico_status_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_ctx_param_name": (c_char_p, [c_int]),
    "bico_ctx_param_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_xcov_flag_name": (c_char_p, [c_int]),
    "bico_xcov_flag_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_xcov_which_name": (c_char_p, [c_int]),
    "bico_xcov_which_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_xcov_set_param": (_S, [c_void_p, c_int, c_double]),
    "bico_xcov_get_param": (_S, [c_void_p, c_int, P(c_double)]),
    "bico_xcov_param_bounds": (_S, [c_int, P(c_double), P(c_double), P(c_uint)]),
    "bico_xcov_param_name": (c_char_p, [c_int]),
    "bico_xcov_param_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_xcov_add_mode_name": (c_char_p, [c_int]),
    "bico_xcov_add_mode_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_procrustes_param_name": (c_char_p, [c_int]),
    "bico_procrustes_param_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_procrustes_method_name": (c_char_p, [c_int]),
    "bico_procrustes_method_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_procrustes_null_name": (c_char_p, [c_int]),
    "bico_procrustes_null_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_votes_flag_name": (c_char_p, [c_int]),
    "bico_votes_flag_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_gradfix_mode_name": (c_char_p, [c_int]),
    "bico_gradfix_mode_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_model_module_kind_name": (c_char_p, [c_int]),
    "bico_model_module_kind_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_model_tensor_role_name": (c_char_p, [c_int]),
    "bico_model_tensor_role_from_name": (_S, [c_char_p, P(c_int)]),
    # xcov
    "bico_xcov_create": (_S, [c_void_p, c_size_t, c_size_t, c_uint, PP]),
    "bico_xcov_free": (None, [c_void_p]),
    "bico_xcov_add": (_S, [c_void_p, c_size_t, c_void_p, c_size_t, c_void_p,
                           c_size_t]),
    "bico_xcov_add_matrix": (_S, [c_void_p, c_uint64, c_void_p, c_size_t]),
    "bico_xcov_merge": (_S, [c_void_p, c_void_p]),
    "bico_xcov_info": (_S, [c_void_p, P(c_size_t), P(c_size_t), P(c_uint64),
                            P(c_uint)]),
    "bico_xcov_matrix": (_S, [c_void_p, c_int, c_int, c_void_p, c_size_t]),
    "bico_xcov_sums": (_S, [c_void_p, c_void_p, c_void_p]),
    "bico_xcov_serialized_size": (_S, [c_void_p, P(c_size_t)]),
    "bico_xcov_serialize": (_S, [c_void_p, c_void_p, c_size_t, P(c_size_t)]),
    "bico_xcov_deserialize": (_S, [c_void_p, c_void_p, c_size_t, PP]),
    # procrustes
    "bico_procrustes_create": (_S, [c_void_p, PP]),
    "bico_procrustes_free": (None, [c_void_p]),
    "bico_procrustes_set_param": (_S, [c_void_p, c_int, c_double]),
    "bico_procrustes_get_param": (_S, [c_void_p, c_int, P(c_double)]),
    "bico_procrustes_param_bounds": (_S, [c_int, P(c_double), P(c_double),
                                          P(c_uint)]),
    "bico_param_flag_name": (c_char_p, [c_int]),
    "bico_param_flag_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_procrustes_solve": (_S, [c_void_p, c_void_p, c_void_p, c_size_t,
                                   P(c_size_t)]),
    "bico_procrustes_solve_matrix": (_S, [c_void_p, c_size_t, c_size_t,
                                          c_void_p, c_size_t, c_void_p,
                                          c_size_t, P(c_size_t)]),
    "bico_procrustes_spectrum": (_S, [c_void_p, c_void_p, c_size_t,
                                      P(c_size_t)]),
    "bico_procrustes_solve_rows": (_S, [c_void_p, c_size_t, c_size_t,
                                        c_size_t, c_void_p, c_size_t,
                                        c_void_p, c_size_t, c_void_p,
                                        c_size_t, P(c_size_t), P(c_int)]),
    # experimental.h (no ABI promise): read(opaque, i0, ni, j0, nj, out, ld)
    # and release(opaque) are C callbacks (ctypes.CFUNCTYPE).
    "bico_procrustes_solve_blocks": (_S, [c_void_p, c_size_t, c_size_t,
                                          c_void_p, c_void_p, c_void_p,
                                          c_void_p, c_size_t, P(c_size_t)]),
    # transport
    "bico_transport_weight": (_S, [c_void_p, c_size_t, c_size_t, c_size_t,
                                   c_size_t, c_float, c_void_p, c_size_t,
                                   c_void_p, c_size_t, c_void_p, c_size_t,
                                   c_float, c_void_p, c_size_t]),
    "bico_transport_weight_split": (_S, [c_void_p, c_size_t, c_size_t,
                                         c_size_t, c_size_t, c_size_t,
                                         c_float, c_void_p, c_size_t,
                                         c_void_p, c_size_t, c_void_p,
                                         c_size_t, c_float, c_void_p,
                                         c_size_t]),
    "bico_transport_vector": (_S, [c_void_p, c_size_t, c_size_t, c_float,
                                   c_void_p, c_void_p, c_size_t, c_float,
                                   c_void_p]),
    "bico_transport_rows": (_S, [c_void_p, c_size_t, c_size_t, c_size_t,
                                 c_float, c_void_p, c_size_t, c_void_p,
                                 c_size_t, c_float, c_void_p, c_size_t]),
    # gradfix
    "bico_votes_create": (_S, [c_void_p, c_size_t, c_uint, PP]),
    "bico_votes_free": (None, [c_void_p]),
    "bico_votes_add_grad": (_S, [c_void_p, c_void_p]),
    "bico_votes_add_counts": (_S, [c_void_p, c_void_p, c_uint32]),
    "bico_votes_merge": (_S, [c_void_p, c_void_p]),
    "bico_votes_info": (_S, [c_void_p, P(c_size_t), P(c_uint64), P(c_uint)]),
    "bico_votes_counts": (_S, [c_void_p, c_void_p]),
    "bico_gradfix_mask": (_S, [c_void_p, c_int, c_void_p, c_void_p,
                               P(c_size_t)]),
    "bico_gradfix_apply": (_S, [c_void_p, c_int, c_float, c_void_p, c_float,
                                c_void_p, P(c_size_t)]),
    # baselines
    "bico_baseline_naive": (_S, [c_void_p, c_size_t, c_void_p, c_size_t,
                                 c_void_p, c_float, c_void_p, c_float,
                                 c_void_p]),
    "bico_baseline_pad": (_S, [c_void_p, c_size_t, c_void_p, c_size_t,
                               c_void_p, c_float, c_void_p, c_float,
                               c_void_p]),
    # depth map
    "bico_depthmap_source": (_S, [c_size_t, c_size_t, c_size_t,
                                  P(c_size_t)]),
    # safetensors
    "bico_dtype_name": (c_char_p, [c_int]),
    "bico_dtype_size": (c_size_t, [c_int]),
    "bico_dtype_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_stfile_open": (_S, [c_void_p, c_char_p, PP]),
    "bico_stfile_free": (None, [c_void_p]),
    "bico_stfile_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_stfile_tensor_info": (_S, [c_void_p, c_size_t, P(c_char_p), P(c_int),
                                     P(c_size_t), P(P(c_size_t))]),
    "bico_stfile_tensor_size": (_S, [c_void_p, c_size_t, P(c_size_t),
                                     P(c_size_t)]),
    "bico_stfile_tensor_path": (_S, [c_void_p, c_size_t, P(c_char_p)]),
    "bico_stfile_find": (_S, [c_void_p, c_char_p, P(c_size_t)]),
    "bico_stfile_data": (_S, [c_void_p, c_size_t, P(c_void_p), P(c_size_t)]),
    "bico_stfile_read_f32": (_S, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "bico_stfile_read_f32_range": (_S, [c_void_p, c_size_t, c_size_t,
                                        c_void_p, c_size_t]),
    "bico_stfile_read_f64": (_S, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "bico_stfile_read_f64_range": (_S, [c_void_p, c_size_t, c_size_t,
                                        c_void_p, c_size_t]),
    "bico_stfile_check_finite": (_S, [c_void_p, c_size_t]),
    "bico_stfile_check_unchanged": (_S, [c_void_p]),
    "bico_stfile_metadata_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_stfile_metadata_at": (_S, [c_void_p, c_size_t, P(c_char_p),
                                     P(c_char_p)]),
    "bico_stfile_metadata_get": (_S, [c_void_p, c_char_p, P(c_char_p)]),
    "bico_stwriter_create": (_S, [c_void_p, c_char_p, PP]),
    "bico_stwriter_free": (None, [c_void_p]),
    "bico_stwriter_add_metadata": (_S, [c_void_p, c_char_p, c_char_p]),
    "bico_stwriter_declare": (_S, [c_void_p, c_char_p, c_int, c_size_t,
                                   c_void_p]),
    "bico_stwriter_write_f32": (_S, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "bico_stwriter_write_f64": (_S, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "bico_stwriter_write_raw": (_S, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "bico_stwriter_write_f32_range": (_S, [c_void_p, c_char_p, c_size_t,
                                           c_void_p, c_size_t]),
    "bico_stwriter_write_f64_range": (_S, [c_void_p, c_char_p, c_size_t,
                                           c_void_p, c_size_t]),
    "bico_stwriter_commit": (_S, [c_void_p]),
    "bico_stwriter_create_folder": (_S, [c_void_p, c_char_p, c_char_p,
                                         c_uint64, PP]),
    "bico_stwriter_output_is_folder": (c_int, [c_char_p, c_char_p]),
    # model graphs
    "bico_model_create": (_S, [c_void_p, PP]),
    "bico_model_from_stfile": (_S, [c_void_p, c_void_p, PP]),
    "bico_model_free": (None, [c_void_p]),
    "bico_model_add_tensor": (_S, [c_void_p, c_char_p, c_int, c_size_t,
                                   c_void_p]),
    "bico_model_set_blocks": (_S, [c_void_p, c_char_p]),
    "bico_model_tensor_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_model_tensor": (_S, [c_void_p, c_size_t, P(c_char_p), P(c_int),
                               P(c_size_t), P(P(c_size_t))]),
    "bico_model_find_tensor": (_S, [c_void_p, c_char_p, P(c_size_t)]),
    "bico_model_tensor_module": (_S, [c_void_p, c_size_t, P(c_size_t),
                                      P(c_int)]),
    "bico_model_module_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_model_module": (_S, [c_void_p, c_size_t, P(c_char_p), P(c_int),
                               P(c_long), P(c_size_t)]),
    "bico_model_module_tensor": (_S, [c_void_p, c_size_t, c_size_t,
                                      P(c_size_t)]),
    "bico_model_find_module": (_S, [c_void_p, c_char_p, P(c_size_t)]),
    "bico_model_module_dims": (_S, [c_void_p, c_size_t, P(c_size_t),
                                    P(c_size_t)]),
    "bico_model_blocks": (_S, [c_void_p, P(c_char_p), P(c_size_t)]),
    "bico_model_map_name": (_S, [c_void_p, c_void_p, c_char_p, c_void_p,
                                 c_size_t, P(c_size_t)]),
    "bico_model_pair_module": (_S, [c_void_p, c_size_t, c_void_p,
                                    P(c_size_t)]),
    "bico_model_pair_tensor": (_S, [c_void_p, c_size_t, c_void_p,
                                    P(c_size_t)]),
    # whole-model transfer
    "bico_transfer_method_name": (c_char_p, [c_int]),
    "bico_transfer_method_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_norm_map_name": (c_char_p, [c_int]),
    "bico_transfer_norm_map_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_structure_name": (c_char_p, [c_int]),
    "bico_transfer_structure_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_rope_name": (c_char_p, [c_int]),
    "bico_transfer_rope_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_fingerprint_name": (c_char_p, [c_int]),
    "bico_transfer_fingerprint_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_create": (_S, [c_void_p, PP]),
    "bico_transfer_free": (None, [c_void_p]),
    "bico_transfer_set_file": (_S, [c_void_p, c_int, c_char_p]),
    "bico_transfer_set_param": (_S, [c_void_p, c_int, c_double]),
    "bico_transfer_get_param": (_S, [c_void_p, c_int, P(c_double)]),
    "bico_transfer_param_bounds": (_S, [c_int, P(c_double), P(c_double),
                                        P(c_uint)]),
    "bico_transfer_param_name": (c_char_p, [c_int]),
    "bico_transfer_param_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_set_xcov": (_S, [c_void_p, c_char_p, c_int, P(c_void_p),
                                    c_size_t]),
    "bico_transfer_set_votes": (_S, [c_void_p, c_char_p, c_void_p]),
    "bico_transfer_side_name": (c_char_p, [c_int]),
    "bico_transfer_side_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_set_string": (_S, [c_void_p, c_int, c_char_p]),
    "bico_transfer_add_split": (_S, [c_void_p, c_char_p, c_size_t]),
    "bico_transfer_add_tie": (_S, [c_void_p, c_char_p, c_char_p]),
    "bico_transfer_set_log": (_S, [c_void_p, c_void_p, c_void_p]),
    "bico_transfer_set_progress": (_S, [c_void_p, c_void_p, c_void_p]),
    "bico_merge_set_progress": (_S, [c_void_p, c_void_p, c_void_p]),
    "bico_merge_method_name": (c_char_p, [c_int]),
    "bico_merge_method_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_run": (_S, [c_void_p]),
    "bico_transfer_bridge": (_S, [c_void_p]),
    "bico_transfer_counts": (_S, [c_void_p, P(c_size_t), P(c_size_t)]),
    "bico_stats_from_calib": (_S, [c_void_p, c_char_p, c_char_p, c_char_p,
                                   c_char_p]),
    "bico_stats_merge": (_S, [c_void_p, c_void_p, c_size_t, c_char_p]),
    "bico_transfer_check": (_S, [c_void_p, c_int]),
    "bico_transfer_file_name": (c_char_p, [c_int]),
    "bico_transfer_file_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_stats_plan_create": (_S, [c_void_p, c_void_p, c_void_p, c_size_t,
                                    c_char_p, P(c_void_p)]),
    "bico_stats_plan_free": (None, [c_void_p]),
    "bico_stats_plan_size": (_S, [c_void_p, P(c_size_t), P(c_size_t)]),
    "bico_stats_plan_item": (_S, [c_void_p, c_size_t, P(c_char_p),
                                  P(c_char_p), P(c_char_p), P(c_size_t),
                                  P(c_size_t)]),
    "bico_stats_plan_rows": (_S, [c_void_p, c_size_t, c_size_t,
                                  P(c_size_t)]),
    # lora.h and merge.h
    "bico_lora_open": (c_int, [c_void_p, c_char_p, P(c_void_p)]),
    "bico_lora_create": (c_int, [c_void_p, P(c_void_p)]),
    "bico_lora_free": (None, [c_void_p]),
    "bico_lora_set_param": (c_int, [c_void_p, c_int, c_double]),
    "bico_lora_get_param": (c_int, [c_void_p, c_int, P(c_double)]),
    "bico_lora_param_name": (c_char_p, [c_int]),
    "bico_lora_param_from_name": (c_int, [c_char_p, P(c_int)]),
    "bico_lora_param_bounds": (c_int, [c_int, P(c_double), P(c_double),
                                       P(c_uint)]),
    "bico_lora_set_string": (c_int, [c_void_p, c_int, c_char_p]),
    "bico_lora_get_string": (c_int, [c_void_p, c_int, P(c_char_p)]),
    "bico_lora_module_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_lora_module": (c_int, [c_void_p, c_size_t, P(c_char_p), P(c_int),
                              P(c_size_t), P(c_size_t), P(c_size_t),
                              P(c_double), P(c_double)]),
    "bico_lora_factors": (c_int, [c_void_p, c_size_t, P(P(c_float)),
                               P(P(c_float))]),
    "bico_lora_add_module": (c_int, [c_void_p, c_char_p, c_int, c_size_t,
                                  c_size_t, c_size_t, c_double, c_void_p,
                                  c_void_p]),
    "bico_lora_saved_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_lora_saved": (c_int, [c_void_p, c_size_t, P(c_char_p), P(c_char_p),
                             P(c_size_t), P(P(c_size_t)), P(P(c_float))]),
    "bico_lora_add_saved": (c_int, [c_void_p, c_char_p, c_char_p, c_size_t,
                                 c_void_p, c_void_p]),
    "bico_lora_save": (c_int, [c_void_p, c_char_p]),
    "bico_lora_transport": (c_int, [c_void_p, c_size_t, c_size_t, c_size_t,
                                 c_size_t, c_size_t, c_size_t, c_float,
                                 c_void_p, c_void_p, c_void_p, c_size_t,
                                 c_void_p, c_size_t, c_void_p, c_void_p]),
    "bico_lora_truncate": (c_int, [c_void_p, c_size_t, c_size_t, c_size_t,
                                c_double, c_void_p, c_size_t, c_void_p,
                                c_void_p, P(c_double)]),
    "bico_merge_tensor": (c_int, [c_void_p, c_int, c_size_t, c_size_t, c_void_p,
                               c_void_p, c_void_p, c_int, c_void_p]),
    "bico_merge_create": (c_int, [c_void_p, P(c_void_p)]),
    "bico_merge_free": (None, [c_void_p]),
    "bico_merge_set_file": (c_int, [c_void_p, c_int, c_char_p]),
    "bico_merge_set_param": (c_int, [c_void_p, c_int, c_double]),
    "bico_merge_get_param": (c_int, [c_void_p, c_int, P(c_double)]),
    "bico_merge_param_name": (c_char_p, [c_int]),
    "bico_merge_param_from_name": (c_int, [c_char_p, P(c_int)]),
    "bico_merge_param_bounds": (c_int, [c_int, P(c_double), P(c_double),
                                        P(c_uint)]),
    "bico_merge_add_input": (c_int, [c_void_p, c_int, c_char_p, c_double,
                                  c_double]),
    "bico_transfer_set_partial": (c_int, [c_void_p, c_void_p, c_size_t,
                                          c_void_p, c_void_p]),
    "bico_transfer_handling_name": (c_char_p, [c_int]),
    "bico_transfer_handling_from_name": (c_int, [c_char_p, P(c_int)]),
    "bico_transfer_check_level_name": (c_char_p, [c_int]),
    "bico_transfer_check_level_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_string_name": (c_char_p, [c_int]),
    "bico_transfer_string_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_merge_input_name": (c_char_p, [c_int]),
    "bico_merge_input_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_merge_file_name": (c_char_p, [c_int]),
    "bico_merge_file_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_lora_kind_name": (c_char_p, [c_int]),
    "bico_lora_kind_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_lora_string_name": (c_char_p, [c_int]),
    "bico_lora_string_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_dtype_is_float": (c_int, [c_int]),
    # folder.h: output folders committed in one step
    "bico_folder_policy_name": (c_char_p, [c_int]),
    "bico_folder_policy_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_folder_create": (_S, [c_void_p, PP]),
    "bico_folder_free": (None, [c_void_p]),
    "bico_folder_add_input": (_S, [c_void_p, c_char_p, c_char_p]),
    "bico_folder_add_file": (_S, [c_void_p, c_char_p, c_char_p]),
    "bico_folder_add_output": (_S, [c_void_p, c_char_p, c_char_p, c_int,
                                    P(c_size_t)]),
    "bico_folder_begin": (_S, [c_void_p]),
    "bico_folder_path": (_S, [c_void_p, c_size_t, P(c_char_p)]),
    "bico_folder_commit": (_S, [c_void_p]),
    "bico_folder_kept": (_S, [c_void_p, c_size_t, P(c_char_p)]),
    # fit.h's names (bico.fit declares the rest of fit.h itself)
    "bico_fit_param_name": (c_char_p, [c_int]),
    "bico_fit_param_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_fit_flag_name": (c_char_p, [c_int]),
    "bico_fit_flag_from_name": (_S, [c_char_p, P(c_int)]),
    "bico_transfer_get_file": (c_int, [c_void_p, c_int, P(c_char_p)]),
    "bico_transfer_plan": (c_int, [c_void_p]),
    # Explaining the plan: the out-structs are passed as buffers whose
    # first size_t is the caller's sizeof (not wrapped in Python yet).
    "bico_transfer_explain": (c_int, [c_void_p]),
    "bico_transfer_explain_count": (c_int, [c_void_p, P(c_size_t)]),
    "bico_transfer_explain_model": (c_int, [c_void_p, c_int, c_void_p]),
    "bico_transfer_explain_tensor": (c_int, [c_void_p, c_size_t, c_void_p]),
    "bico_transfer_explain_vocab": (c_int, [c_void_p, P(c_size_t), P(c_size_t),
                                            P(c_size_t), P(c_size_t)]),
    "bico_transfer_plan_size": (c_int, [c_void_p, P(c_size_t), P(c_size_t)]),
    "bico_transfer_plan_group": (c_int, [c_void_p, c_size_t, P(c_double),
                                         P(c_size_t), P(c_void_p)]),
    "bico_transfer_assemble_begin": (c_int, [c_void_p]),
    "bico_transfer_assemble_put": (c_int, [c_void_p, c_size_t, c_int,
                                           c_void_p, c_size_t, c_char_p]),
    "bico_transfer_assemble_commit": (c_int, [c_void_p]),
    "bico_merge_set_log": (c_int, [c_void_p, c_void_p, c_void_p]),
    "bico_lora_find_module": (c_int, [c_void_p, c_char_p, P(c_size_t)]),
    "bico_lora_dense": (c_int, [c_void_p, c_size_t, c_float, c_float,
                                c_void_p, c_size_t]),
    "bico_merge_run": (c_int, [c_void_p]),
    "bico_merge_check": (c_int, [c_void_p, c_int]),
}

# bico_transfer_log_fn
LOG_FN = ctypes.CFUNCTYPE(None, c_void_p, c_char_p)


class Progress(ctypes.Structure):
    """include/bico/ctx.h's bico_progress."""
    _fields_ = [("size", c_size_t), ("done", c_double), ("total", c_double),
                ("tensors_done", c_size_t), ("tensors_total", c_size_t),
                ("elapsed", c_double), ("tensor", c_char_p)]


PROGRESS_FN = ctypes.CFUNCTYPE(None, c_void_p, ctypes.POINTER(Progress))


class _Missing(object):
    """Stands in for a function this build of libbico does not export."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args):
        raise NotImplementedError(
            "%s is not exported by %s (an older or partial libbico build)"
            % (self.name, library_path))


class _Funcs(object):
    pass


fn = _Funcs()
missing = []
for _name, (_res, _args) in PROTOTYPES.items():
    try:
        _f = getattr(lib, _name)
    except AttributeError:
        setattr(fn, _name[5:], _Missing(_name))
        missing.append(_name)
        continue
    _f.restype = _res
    _f.argtypes = _args
    setattr(fn, _name[5:], _f)


def has(name):
    """True when the loaded library exports bico_<name>."""
    f = getattr(fn, name, None)
    return f is not None and not isinstance(f, _Missing)
