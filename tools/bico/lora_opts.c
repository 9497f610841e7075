/* bico transfer --lora: the --merge-into-base flag.  Which files go
 * together is the library's rule (bico_transfer_check); the flag is the
 * command's own: it says that --output means the adapter merged into the
 * target base. */
#include "cli.h"

int lora_cli_check(const char *cmd, const char *output, int merge_into_base) {
  if (merge_into_base && output == NULL)
    return cli_error(cmd, CLI_USAGE,
                     "--merge-into-base needs --output (the full target "
                     "checkpoint)");
  if (output != NULL && !merge_into_base)
    return cli_error(cmd, CLI_USAGE,
                     "with --lora, --output writes a full checkpoint: add "
                     "--merge-into-base to say so, or use --output-lora");
  return 0;
}
