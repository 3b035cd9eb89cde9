// flashmla/flashmla.h — umbrella header of the framework-free core library.
#pragma once
#include "flashmla/kv_format.h"
#include "flashmla/ops.h"
#include "flashmla/status.h"
#include "flashmla/tensor.h"
