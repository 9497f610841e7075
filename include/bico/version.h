/* libbico: versions and the export macro.
 *
 * The ABI major version is the SONAME: libbico.so.1.  Symbols are only ever
 * added within a major version; each release that adds some gets its own
 * node in lib/libbico.vers and a line in CHANGELOG.md. */
#ifndef BICO_VERSION_H
#define BICO_VERSION_H

#define BICO_VERSION_MAJOR 1
#define BICO_VERSION_MINOR 0
#define BICO_VERSION_PATCH 0
#define BICO_VERSION_NUMBER \
  (BICO_VERSION_MAJOR * 10000 + BICO_VERSION_MINOR * 100 + BICO_VERSION_PATCH)
#define BICO_VERSION_STRING "1.0.0"

#if defined(BICO_BUILDING_LIBRARY) && defined(__GNUC__)
#define BICO_API __attribute__((visibility("default")))
#else
#define BICO_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the library actually linked, as "MAJOR.MINOR.PATCH" and as
 * MAJOR*10000 + MINOR*100 + PATCH.  Compare with the macros to detect a
 * header/library mismatch. */
BICO_API const char *bico_version_string(void);
BICO_API unsigned bico_version_number(void);

#ifdef __cplusplus
}
#endif
#endif
