#ifndef BICO_TRANSFER_H
#define BICO_TRANSFER_H
#endif
