/* bico transfer --lora: which files go together. */
#include "cli.h"

int lora_cli_check(const char *cmd, const char *tuned, const char *task_vector,
                   const char *output, const char *delta_output,
                   const char *output_lora, int merge_into_base) {
  if (tuned != NULL || task_vector != NULL)
    return cli_error(cmd, CLI_USAGE,
                     "--lora replaces --source-tuned and --task-vector; give "
                     "only one source of the task");
  if (delta_output != NULL)
    return cli_error(cmd, CLI_USAGE,
                     "--delta-output does not apply to --lora: the adapter "
                     "written by --output-lora is the update");
  if (merge_into_base && output == NULL)
    return cli_error(cmd, CLI_USAGE,
                     "--merge-into-base needs --output (the full target "
                     "checkpoint)");
  if (output != NULL && !merge_into_base)
    return cli_error(cmd, CLI_USAGE,
                     "with --lora, --output writes a full checkpoint: add "
                     "--merge-into-base to say so, or use --output-lora");
  if (output_lora == NULL && output == NULL)
    return cli_error(cmd, CLI_USAGE,
                     "--lora needs --output-lora OUT_DIR and/or "
                     "--merge-into-base --output FILE");
  return 0;
}
