/**
 * @file comm_nccl.h
 * @brief NCCL, and from 2.28 its device API, for the .cu files that use them: the NCCL
 *        transport (comm_nccl.cu) and chapter 02's fused dispatcher (dispatch_nvlink.cu).
 *
 * The transport itself is declared by lib (lib/comm_transport.h:
 * moe_comm_transport_nccl()); this header only decides what of NCCL a build has. The
 * device API gives symmetric memory windows that kernels of every rank load from and
 * store to, and barriers between those kernels. Its structures are inlined into our
 * kernels, so the headers must be those of the library that runs (the transport's
 * device_api hook checks).
 */
#ifndef MOE_COMM_NCCL_H
#define MOE_COMM_NCCL_H

#ifdef __CUDACC__
#include <nccl.h>
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define MOE_NCCL_DEVICE_API 1
#include <nccl_device.h>
#endif
#endif

#endif /* MOE_COMM_NCCL_H */
