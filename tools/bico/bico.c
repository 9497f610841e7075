/* The bico command's entry point (the dispatcher is tools/bico/main.c). */
#include "cli.h"

int main(int argc, char **argv) { return bico_cli_main(argc, argv); }
