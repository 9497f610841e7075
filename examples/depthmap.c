/* Pair the layers of two models of different depth (bico_depthmap_source).
 *
 * A target of L_B blocks takes, for its block j, the source block
 *   i(j) = round(j (L_A - 1) / (L_B - 1))      (halves round up)
 * so the first blocks pair, the last blocks pair, and the rest spread
 * evenly; a one-block target takes block 0.  bico_model and bico_transfer
 * pair module names with it ("blocks.5.mlp" -> "blocks.2.mlp"); this is
 * the formula alone: a pure function of three numbers, no context.
 *
 * The program prints the map for a 6-block source and targets of several
 * depths, and checks every entry against the formula computed here in
 * integers (round half up: floor((2 j (L_A - 1) + (L_B - 1)) / (2 (L_B - 1)))). */
#include <stdio.h>
#include <bico/bico.h>

static size_t formula(size_t la, size_t lb, size_t j) {
  if (lb == 1) return 0;
  return (2 * j * (la - 1) + (lb - 1)) / (2 * (lb - 1));
}

int main(void) {
  const size_t la = 6, depths[] = {1, 3, 6, 8, 12};
  int bad = 0;
  for (size_t d = 0; d < sizeof depths / sizeof *depths; d++) {
    size_t lb = depths[d];
    printf("source 6 -> target %2zu:", lb);
    for (size_t j = 0; j < lb; j++) {
      size_t i = 0;
      bico_status st = bico_depthmap_source(la, lb, j, &i);
      if (st != BICO_OK) {
        printf("\n%s\n", bico_strerror(st));
        return 1;
      }
      printf(" %zu", i);
      if (i != formula(la, lb, j)) bad = 1;
    }
    printf("\n");
  }
  /* A formula has no context to hold a message: its status says it all. */
  size_t i = 99;
  bico_status past = bico_depthmap_source(la, 3, 3, &i);  /* j >= L_B */
  bico_status none = bico_depthmap_source(0, 3, 0, &i);   /* L_A = 0 */
  printf("block 3 of 3: %s; a source without blocks: %s\n",
         bico_status_name(past), bico_status_name(none));
  if (past != BICO_E_ARG || none != BICO_E_SHAPE || i != 99) bad = 1;
  printf("depthmap: %s\n", bad ? "WRONG" : "ok");
  return bad;
}
