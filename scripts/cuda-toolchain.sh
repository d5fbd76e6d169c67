#!/usr/bin/env bash
# Recreate the CUDA 13.0 build toolchain (PyPI wheels, no GPU/driver needed) in one go.
# Needs only python3 + pip (reaching PyPI) + gcc.  Usage: scripts/cuda-toolchain.sh [TARGET_DIR=.cache/cuda]; see docs/cuda-build.md
# Afterwards: source TARGET_DIR/env.sh && cargo build --release --features cuda
set -euo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
T="$(mkdir -p "${1:-.cache/cuda}" && cd "${1:-.cache/cuda}" && pwd)"
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
        nvidia-cublas==13.1.0.3 nvidia-curand==10.4.0.35)     # = CUDA 13.0 Update 2 component set
python3 -m pip install --no-deps --upgrade --target "$T/site" "${WHEELS[@]}"
R="$T/site/nvidia/cu13"
chmod +x "$R"/bin/* "$R"/nvvm/bin/*           # zip-unpacking drops exec bits; pip keeps them
rm -f "$R"/lib/libnvrtc.alt.so.13 "$R"/lib/libnvrtc-builtins.alt.so.13.0   # unused, -110 MB
cd "$R/lib"
for p in cudart:libcudart.so.13 cublas:libcublas.so.13 cublasLt:libcublasLt.so.13 \
         curand:libcurand.so.10 nvrtc:libnvrtc.so.13 nvblas:libnvblas.so.13; do
  ln -sfn "${p#*:}" "lib${p%%:*}.so"
done
cd "$R" && ln -sfn lib lib64                  # cudaforge derives lib64 from nvcc's location
# libcuda stub (soname libcuda.so.1): one `int f(void){return 999;}` per driver symbol that
# cudarc 0.19.10 declares (embedded list below, unioned with the local cudarc source if present).
mkdir -p "$T/stub" "$R/lib/stubs"
{ sed -n '/^__SYMBOLS__$/,$p' "$SELF" | tail -n +2
  for m in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs; do
    if [ -f "$m" ]; then grep -oE "^\s+fn (cu[A-Za-z0-9_]+)\(" "$m" | sed -E 's/.*fn (cu[A-Za-z0-9_]+)\(/\1/'; fi
  done; } | grep -E '^cu[A-Za-z0-9_]+$' | sort -u > "$T/stub/symbols.txt"
sed 's/.*/int &(void){return 999;}/' "$T/stub/symbols.txt" > "$T/stub/libcuda_stub.c"
gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$R/lib/stubs/libcuda.so" "$T/stub/libcuda_stub.c"
ln -sfn libcuda.so "$R/lib/stubs/libcuda.so.1"
ln -sfn stubs/libcuda.so "$R/lib/libcuda.so"
cat > "$T/env.sh" <<'ENV'
# Source me:  source <TARGET_DIR>/env.sh && cargo build --release --features cuda
# CUDA 13.0 toolchain from PyPI wheels (no GPU, no system CUDA). See docs/cuda-build.md.
_cuda_here="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
export CUDA_ROOT="$_cuda_here/site/nvidia/cu13"
export CUDA_HOME="$CUDA_ROOT" CUDA_PATH="$CUDA_ROOT" CUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT"
export NVCC="$CUDA_ROOT/bin/nvcc"
export PATH="$CUDA_ROOT/bin:$PATH"
# lib/ has the unversioned .so links; lib/stubs/ has the libcuda.so stub (soname libcuda.so.1).
export LIBRARY_PATH="$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
# lib/stubs here lets a cuda binary/test *start* on this GPU-less box (it then gets a DriverError).
# Never put lib/stubs on LD_LIBRARY_PATH on a machine with a real driver.
export LD_LIBRARY_PATH="$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13000
export CUDAFORGE_THREADS=2
unset _cuda_here
ENV
# Self-test: nvcc version, bf16/fp16 kernel -> PTX and -fPIC object, link against the libs.
source "$T/env.sh"
W="$(mktemp -d)"; cd "$W"
nvcc --version | grep -q 'release 13.0' && echo "nvcc: $(nvcc --version | grep release)"
cat > t.cu <<'CU'
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <thrust/scan.h>
extern "C" __global__ void k(const __nv_bfloat16* x, __half* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __hadd(__float2half(__bfloat162float(x[i])), y[i]);
}
CU
nvcc --ptx -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -O3 t.cu -o t.ptx
grep -E '^\.(version|target)' t.ptx
nvcc -c -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -O3 -Xcompiler -fPIC t.cu -o t.o
printf '#include <cuda.h>\n#include <cuda_runtime_api.h>\n#include <cublas_v2.h>\n#include <curand.h>\n#include <nvrtc.h>\n#include <stdio.h>\nint main(void){int a,b;cublasHandle_t h;nvrtcVersion(&a,&b);printf("cuInit=%%d nvrtc=%%d.%%d cublasCreate=%%d\\n",(int)cuInit(0),a,b,(int)cublasCreate(&h));return 0;}\n' > m.c
gcc -I"$CUDA_ROOT/include" m.c t.o -o m -lcudart -lcublas -lcublasLt -lcurand -lnvrtc -lcuda -lstdc++
./m     # expected without a GPU: cuInit=999 (stub) nvrtc=13.0 cublasCreate=1 (not initialized)
cd / && rm -rf "$W"
echo "OK: CUDA_ROOT=$CUDA_ROOT ($(du -sh "$T/site" | cut -f1))"
exit 0
__SYMBOLS__
cuArray3DCreate_v2
cuArray3DGetDescriptor_v2
cuArrayCreate_v2
cuArrayDestroy
cuArrayGetDescriptor_v2
cuArrayGetMemoryRequirements
cuArrayGetPlane
cuArrayGetSparseProperties
cuCoredumpDeregisterCompleteCallback
cuCoredumpDeregisterStartCallback
cuCoredumpGetAttribute
cuCoredumpGetAttributeGlobal
cuCoredumpRegisterCompleteCallback
cuCoredumpRegisterStartCallback
cuCoredumpSetAttribute
cuCoredumpSetAttributeGlobal
cuCtxAttach
cuCtxCreate_v2
cuCtxCreate_v3
cuCtxCreate_v4
cuCtxDestroy_v2
cuCtxDetach
cuCtxDisablePeerAccess
cuCtxEnablePeerAccess
cuCtxFromGreenCtx
cuCtxGetApiVersion
cuCtxGetCacheConfig
cuCtxGetCurrent
cuCtxGetDevResource
cuCtxGetDevice
cuCtxGetDevice_v2
cuCtxGetExecAffinity
cuCtxGetFlags
cuCtxGetId
cuCtxGetLimit
cuCtxGetSharedMemConfig
cuCtxGetStreamPriorityRange
cuCtxPopCurrent_v2
cuCtxPushCurrent_v2
cuCtxRecordEvent
cuCtxResetPersistingL2Cache
cuCtxSetCacheConfig
cuCtxSetCurrent
cuCtxSetFlags
cuCtxSetLimit
cuCtxSetSharedMemConfig
cuCtxSynchronize
cuCtxSynchronize_v2
cuCtxWaitEvent
cuDestroyExternalMemory
cuDestroyExternalSemaphore
cuDevResourceGenerateDesc
cuDevSmResourceSplit
cuDevSmResourceSplitByCount
cuDeviceCanAccessPeer
cuDeviceComputeCapability
cuDeviceGet
cuDeviceGetAttribute
cuDeviceGetByPCIBusId
cuDeviceGetCliqueCount
cuDeviceGetCliqueInfo
cuDeviceGetCount
cuDeviceGetDefaultMemPool
cuDeviceGetDevResource
cuDeviceGetExecAffinitySupport
cuDeviceGetFabricClusterUuid
cuDeviceGetGraphMemAttribute
cuDeviceGetHostAtomicCapabilities
cuDeviceGetLuid
cuDeviceGetMemPool
cuDeviceGetName
cuDeviceGetP2PAtomicCapabilities
cuDeviceGetP2PAttribute
cuDeviceGetPCIBusId
cuDeviceGetProperties
cuDeviceGetTexture1DLinearMaxWidth
cuDeviceGetUuid
cuDeviceGetUuid_v2
cuDeviceGraphMemTrim
cuDevicePrimaryCtxGetState
cuDevicePrimaryCtxRelease_v2
cuDevicePrimaryCtxReset_v2
cuDevicePrimaryCtxRetain
cuDevicePrimaryCtxSetFlags_v2
cuDeviceRegisterAsyncNotification
cuDeviceSetGraphMemAttribute
cuDeviceSetMemPool
cuDeviceTotalMem_v2
cuDeviceUnregisterAsyncNotification
cuDriverGetVersion
cuEventCreate
cuEventDestroy_v2
cuEventElapsedTime
cuEventElapsedTime_v2
cuEventQuery
cuEventRecord
cuEventRecordWithFlags
cuEventSynchronize
cuExternalMemoryGetMappedBuffer
cuExternalMemoryGetMappedMipmappedArray
cuFlushGPUDirectRDMAWrites
cuFuncGetAttribute
cuFuncGetModule
cuFuncGetName
cuFuncGetParamCount
cuFuncGetParamInfo
cuFuncIsLoaded
cuFuncLoad
cuFuncSetAttribute
cuFuncSetBlockShape
cuFuncSetCacheConfig
cuFuncSetSharedMemConfig
cuFuncSetSharedSize
cuGetErrorName
cuGetErrorString
cuGetExportTable
cuGetProcAddress
cuGetProcAddress_v2
cuGraphAddBatchMemOpNode
cuGraphAddChildGraphNode
cuGraphAddDependencies
cuGraphAddDependencies_v2
cuGraphAddEmptyNode
cuGraphAddEventRecordNode
cuGraphAddEventWaitNode
cuGraphAddExternalSemaphoresSignalNode
cuGraphAddExternalSemaphoresWaitNode
cuGraphAddHostNode
cuGraphAddKernelNode
cuGraphAddKernelNode_v2
cuGraphAddMemAllocNode
cuGraphAddMemFreeNode
cuGraphAddMemcpyNode
cuGraphAddMemsetNode
cuGraphAddNode
cuGraphAddNode_v2
cuGraphAddNode_v3
cuGraphBatchMemOpNodeGetParams
cuGraphBatchMemOpNodeSetParams
cuGraphChildGraphNodeGetGraph
cuGraphClone
cuGraphConditionalHandleCreate
cuGraphCreate
cuGraphDebugDotPrint
cuGraphDestroy
cuGraphDestroyNode
cuGraphEventRecordNodeGetEvent
cuGraphEventRecordNodeSetEvent
cuGraphEventWaitNodeGetEvent
cuGraphEventWaitNodeSetEvent
cuGraphExecBatchMemOpNodeSetParams
cuGraphExecChildGraphNodeSetParams
cuGraphExecDestroy
cuGraphExecEventRecordNodeSetEvent
cuGraphExecEventWaitNodeSetEvent
cuGraphExecExternalSemaphoresSignalNodeSetParams
cuGraphExecExternalSemaphoresWaitNodeSetParams
cuGraphExecGetFlags
cuGraphExecGetId
cuGraphExecHostNodeSetParams
cuGraphExecKernelNodeSetParams
cuGraphExecKernelNodeSetParams_v2
cuGraphExecMemcpyNodeSetParams
cuGraphExecMemsetNodeSetParams
cuGraphExecNodeSetParams
cuGraphExecUpdate
cuGraphExecUpdate_v2
cuGraphExternalSemaphoresSignalNodeGetParams
cuGraphExternalSemaphoresSignalNodeSetParams
cuGraphExternalSemaphoresWaitNodeGetParams
cuGraphExternalSemaphoresWaitNodeSetParams
cuGraphGetEdges
cuGraphGetEdges_v2
cuGraphGetId
cuGraphGetNodes
cuGraphGetRootNodes
cuGraphHostNodeGetParams
cuGraphHostNodeSetParams
cuGraphInstantiateWithFlags
cuGraphInstantiateWithParams
cuGraphInstantiate_v2
cuGraphKernelNodeCopyAttributes
cuGraphKernelNodeGetAttribute
cuGraphKernelNodeGetParams
cuGraphKernelNodeGetParams_v2
cuGraphKernelNodeSetAttribute
cuGraphKernelNodeSetParams
cuGraphKernelNodeSetParams_v2
cuGraphLaunch
cuGraphMemAllocNodeGetParams
cuGraphMemFreeNodeGetParams
cuGraphMemcpyNodeGetParams
cuGraphMemcpyNodeSetParams
cuGraphMemsetNodeGetParams
cuGraphMemsetNodeSetParams
cuGraphNodeFindInClone
cuGraphNodeGetContainingGraph
cuGraphNodeGetDependencies
cuGraphNodeGetDependencies_v2
cuGraphNodeGetDependentNodes
cuGraphNodeGetDependentNodes_v2
cuGraphNodeGetEnabled
cuGraphNodeGetLocalId
cuGraphNodeGetParams
cuGraphNodeGetToolsId
cuGraphNodeGetType
cuGraphNodeSetEnabled
cuGraphNodeSetParams
cuGraphNodeSetParams_v2
cuGraphReleaseUserObject
cuGraphRemoveDependencies
cuGraphRemoveDependencies_v2
cuGraphRetainUserObject
cuGraphUpload
cuGraphicsMapResources
cuGraphicsResourceGetMappedMipmappedArray
cuGraphicsResourceGetMappedPointer_v2
cuGraphicsResourceSetMapFlags_v2
cuGraphicsSubResourceGetMappedArray
cuGraphicsUnmapResources
cuGraphicsUnregisterResource
cuGreenCtxCreate
cuGreenCtxDestroy
cuGreenCtxGetDevResource
cuGreenCtxGetId
cuGreenCtxRecordEvent
cuGreenCtxStreamCreate
cuGreenCtxWaitEvent
cuImportExternalMemory
cuImportExternalSemaphore
cuInit
cuIpcCloseMemHandle
cuIpcGetEventHandle
cuIpcGetMemHandle
cuIpcOpenEventHandle
cuIpcOpenMemHandle_v2
cuKernelGetAttribute
cuKernelGetFunction
cuKernelGetLibrary
cuKernelGetName
cuKernelGetParamCount
cuKernelGetParamInfo
cuKernelSetAttribute
cuKernelSetCacheConfig
cuLaunch
cuLaunchCooperativeKernel
cuLaunchCooperativeKernelMultiDevice
cuLaunchGrid
cuLaunchGridAsync
cuLaunchHostFunc
cuLaunchHostFunc_v2
cuLaunchKernel
cuLaunchKernelEx
cuLibraryEnumerateKernels
cuLibraryGetGlobal
cuLibraryGetKernel
cuLibraryGetKernelCount
cuLibraryGetManaged
cuLibraryGetModule
cuLibraryGetUnifiedFunction
cuLibraryLoadData
cuLibraryLoadFromFile
cuLibraryUnload
cuLinkAddData_v2
cuLinkAddFile_v2
cuLinkComplete
cuLinkCreate_v2
cuLinkDestroy
cuLogicalEndpointAddDevice
cuLogicalEndpointBindAddr
cuLogicalEndpointBindMem
cuLogicalEndpointCreate
cuLogicalEndpointDestroy
cuLogicalEndpointExport
cuLogicalEndpointGetLimits
cuLogicalEndpointIdRelease
cuLogicalEndpointIdReserve
cuLogicalEndpointImport
cuLogicalEndpointQuery
cuLogicalEndpointUnbind
cuLogsCurrent
cuLogsDumpToFile
cuLogsDumpToMemory
cuLogsRegisterCallback
cuLogsUnregisterCallback
cuMemAddressFree
cuMemAddressReserve
cuMemAdvise
cuMemAdvise_v2
cuMemAllocAsync
cuMemAllocFromPoolAsync
cuMemAllocHost_v2
cuMemAllocManaged
cuMemAllocPitch_v2
cuMemAlloc_v2
cuMemBatchDecompressAsync
cuMemCreate
cuMemDiscardAndPrefetchBatchAsync
cuMemDiscardBatchAsync
cuMemExportToShareableHandle
cuMemFreeAsync
cuMemFreeHost
cuMemFree_v2
cuMemGetAccess
cuMemGetAddressRange_v2
cuMemGetAllocationGranularity
cuMemGetAllocationPropertiesFromHandle
cuMemGetDefaultMemPool
cuMemGetHandleForAddressRange
cuMemGetInfo_v2
cuMemGetLocationInfo
cuMemGetMemPool
cuMemHostAlloc
cuMemHostGetDevicePointer_v2
cuMemHostGetFlags
cuMemHostRegister_v2
cuMemHostUnregister
cuMemImportFromShareableHandle
cuMemMap
cuMemMapArrayAsync
cuMemPoolCreate
cuMemPoolDestroy
cuMemPoolExportPointer
cuMemPoolExportToShareableHandle
cuMemPoolGetAccess
cuMemPoolGetAttribute
cuMemPoolImportFromShareableHandle
cuMemPoolImportPointer
cuMemPoolSetAccess
cuMemPoolSetAttribute
cuMemPoolTrimTo
cuMemPrefetchAsync
cuMemPrefetchAsync_v2
cuMemPrefetchBatchAsync
cuMemRangeGetAttribute
cuMemRangeGetAttributes
cuMemRelease
cuMemRetainAllocationHandle
cuMemSetAccess
cuMemSetMemPool
cuMemUnmap
cuMemcpy
cuMemcpy2DAsync_v2
cuMemcpy2DUnaligned_v2
cuMemcpy2D_v2
cuMemcpy3DAsync_v2
cuMemcpy3DBatchAsync
cuMemcpy3DBatchAsync_v2
cuMemcpy3DPeer
cuMemcpy3DPeerAsync
cuMemcpy3DWithAttributesAsync
cuMemcpy3D_v2
cuMemcpyAsync
cuMemcpyAtoA_v2
cuMemcpyAtoD_v2
cuMemcpyAtoHAsync_v2
cuMemcpyAtoH_v2
cuMemcpyBatchAsync
cuMemcpyBatchAsync_v2
cuMemcpyDtoA_v2
cuMemcpyDtoDAsync_v2
cuMemcpyDtoD_v2
cuMemcpyDtoHAsync_v2
cuMemcpyDtoH_v2
cuMemcpyHtoAAsync_v2
cuMemcpyHtoA_v2
cuMemcpyHtoDAsync_v2
cuMemcpyHtoD_v2
cuMemcpyPeer
cuMemcpyPeerAsync
cuMemcpyWithAttributesAsync
cuMemsetD16Async
cuMemsetD16_v2
cuMemsetD2D16Async
cuMemsetD2D16_v2
cuMemsetD2D32Async
cuMemsetD2D32_v2
cuMemsetD2D8Async
cuMemsetD2D8_v2
cuMemsetD32Async
cuMemsetD32_v2
cuMemsetD8Async
cuMemsetD8_v2
cuMipmappedArrayCreate
cuMipmappedArrayDestroy
cuMipmappedArrayGetLevel
cuMipmappedArrayGetMemoryRequirements
cuMipmappedArrayGetSparseProperties
cuModuleEnumerateFunctions
cuModuleGetFunction
cuModuleGetFunctionCount
cuModuleGetGlobal_v2
cuModuleGetLoadingMode
cuModuleGetSurfRef
cuModuleGetTexRef
cuModuleLoad
cuModuleLoadData
cuModuleLoadDataEx
cuModuleLoadFatBinary
cuModuleUnload
cuMulticastAddDevice
cuMulticastBindAddr
cuMulticastBindAddr_v2
cuMulticastBindMem
cuMulticastBindMem_v2
cuMulticastCreate
cuMulticastGetGranularity
cuMulticastUnbind
cuOccupancyAvailableDynamicSMemPerBlock
cuOccupancyMaxActiveBlocksPerMultiprocessor
cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags
cuOccupancyMaxActiveClusters
cuOccupancyMaxPotentialBlockSize
cuOccupancyMaxPotentialBlockSizeWithFlags
cuOccupancyMaxPotentialClusterSize
cuParamSetSize
cuParamSetTexRef
cuParamSetf
cuParamSeti
cuParamSetv
cuPointerGetAttribute
cuPointerGetAttributes
cuPointerSetAttribute
cuProfilerInitialize
cuProfilerStart
cuProfilerStop
cuSignalExternalSemaphoresAsync
cuStreamAddCallback
cuStreamAttachMemAsync
cuStreamBatchMemOp
cuStreamBatchMemOp_v2
cuStreamBeginCaptureToCig
cuStreamBeginCaptureToGraph
cuStreamBeginCapture_v2
cuStreamBeginRecaptureToGraph
cuStreamCopyAttributes
cuStreamCreate
cuStreamCreateWithPriority
cuStreamDestroy_v2
cuStreamEndCapture
cuStreamEndCaptureToCig
cuStreamGetAttribute
cuStreamGetCaptureInfo
cuStreamGetCaptureInfo_v2
cuStreamGetCaptureInfo_v3
cuStreamGetCtx
cuStreamGetCtx_v2
cuStreamGetDevResource
cuStreamGetDevice
cuStreamGetFlags
cuStreamGetGreenCtx
cuStreamGetId
cuStreamGetPriority
cuStreamIsCapturing
cuStreamQuery
cuStreamSetAttribute
cuStreamSynchronize
cuStreamUpdateCaptureDependencies
cuStreamUpdateCaptureDependencies_v2
cuStreamWaitEvent
cuStreamWaitValue32
cuStreamWaitValue32_v2
cuStreamWaitValue64
cuStreamWaitValue64_v2
cuStreamWriteValue32
cuStreamWriteValue32_v2
cuStreamWriteValue64
cuStreamWriteValue64_v2
cuSurfObjectCreate
cuSurfObjectDestroy
cuSurfObjectGetResourceDesc
cuSurfRefGetArray
cuSurfRefSetArray
cuTensorMapEncodeIm2col
cuTensorMapEncodeIm2colWide
cuTensorMapEncodeTiled
cuTensorMapReplaceAddress
cuTexObjectCreate
cuTexObjectDestroy
cuTexObjectGetResourceDesc
cuTexObjectGetResourceViewDesc
cuTexObjectGetTextureDesc
cuTexRefCreate
cuTexRefDestroy
cuTexRefGetAddressMode
cuTexRefGetAddress_v2
cuTexRefGetArray
cuTexRefGetBorderColor
cuTexRefGetFilterMode
cuTexRefGetFlags
cuTexRefGetFormat
cuTexRefGetMaxAnisotropy
cuTexRefGetMipmapFilterMode
cuTexRefGetMipmapLevelBias
cuTexRefGetMipmapLevelClamp
cuTexRefGetMipmappedArray
cuTexRefSetAddress2D_v3
cuTexRefSetAddressMode
cuTexRefSetAddress_v2
cuTexRefSetArray
cuTexRefSetBorderColor
cuTexRefSetFilterMode
cuTexRefSetFlags
cuTexRefSetFormat
cuTexRefSetMaxAnisotropy
cuTexRefSetMipmapFilterMode
cuTexRefSetMipmapLevelBias
cuTexRefSetMipmapLevelClamp
cuTexRefSetMipmappedArray
cuThreadExchangeStreamCaptureMode
cuUserObjectCreate
cuUserObjectRelease
cuUserObjectRetain
cuWaitExternalSemaphoresAsync
