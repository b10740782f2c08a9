// A prim file that includes the memory layer: the layer check must fail on it.
#include <memascend/pinned_pool.h>
