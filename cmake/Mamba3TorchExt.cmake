# The compiled torch front end mamba3_kernels._C (src/torch_ext/binding.cpp).
#
# find_package(Torch) is not used (its CUDA/cuDNN detection is fragile and needs the CUDA toolkit);
# the Python interpreter that has torch is asked instead for torch's include and library
# directories, its C++ ABI, the Python include directory and the extension suffix. The module is a
# plain C++ file (no CUDA header: the current CUDA stream comes from c10's device-guard interface)
# linked against c10, torch, torch_cpu, torch_python and libmamba3 (rpath $ORIGIN: the installed
# module finds libmamba3.so next to it).
#
#   mamba3_probe_torch(<python> <ok_var>)      sets MAMBA3_TORCH_* in the caller's scope
#   mamba3_add_torch_ext(<target> <mamba3_target>)

set(MAMBA3_TORCH_EXT_SOURCE ${CMAKE_CURRENT_LIST_DIR}/../src/torch_ext/binding.cpp)

function(mamba3_probe_torch python ok_var)
  set(${ok_var} FALSE PARENT_SCOPE)
  # One "key=value" line each; include and library directories are ';'-joined CMake lists.
  set(script [=[
import sysconfig
import torch
import warnings
warnings.simplefilter("ignore")
import torch.utils.cpp_extension as ce
flags = getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])()
print("include=" + ";".join(ce.include_paths()))
print("libdirs=" + ";".join(ce.library_paths()))
print("abi=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("pyinc=" + sysconfig.get_paths()["include"])
print("suffix=" + sysconfig.get_config_var("EXT_SUFFIX"))
print("version=" + torch.__version__)
print("defs=" + ";".join(f[2:] for f in flags if f.startswith("-D")))
]=])
  execute_process(COMMAND "${python}" -c "${script}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(STRIP "${err}" err)
    string(REGEX MATCH "[^\n]*$" last "${err}")
    set(MAMBA3_TORCH_PROBE_ERROR "${last}" PARENT_SCOPE)
    return()
  endif()
  foreach(key include libdirs abi pyinc suffix version defs)
    if(NOT out MATCHES "(^|\n)${key}=([^\n]*)")
      set(MAMBA3_TORCH_PROBE_ERROR "no '${key}' in the probe output: ${out}" PARENT_SCOPE)
      return()
    endif()
    set(v_${key} "${CMAKE_MATCH_2}")
  endforeach()
  set(MAMBA3_TORCH_INCLUDE_DIRS "${v_include}" PARENT_SCOPE)
  set(MAMBA3_TORCH_LIBRARY_DIRS "${v_libdirs}" PARENT_SCOPE)
  set(MAMBA3_TORCH_CXX11_ABI "${v_abi}" PARENT_SCOPE)
  set(MAMBA3_TORCH_PYTHON_INCLUDE "${v_pyinc}" PARENT_SCOPE)
  set(MAMBA3_TORCH_EXT_SUFFIX "${v_suffix}" PARENT_SCOPE)
  set(MAMBA3_TORCH_VERSION "${v_version}" PARENT_SCOPE)
  set(MAMBA3_TORCH_PYBIND_DEFS "${v_defs}" PARENT_SCOPE)
  set(${ok_var} TRUE PARENT_SCOPE)
endfunction()

function(mamba3_add_torch_ext target mamba3_target)
  add_library(${target} MODULE ${MAMBA3_TORCH_EXT_SOURCE})
  set_target_properties(${target} PROPERTIES
    OUTPUT_NAME "_C" PREFIX "" SUFFIX "${MAMBA3_TORCH_EXT_SUFFIX}"
    CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON  # recent torch headers need C++20
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    # $ORIGIN: libmamba3.so next to the module (build dir, installed package); torch's libraries
    # are already loaded by `import torch` when the package imports the module.
    BUILD_RPATH "$ORIGIN;${MAMBA3_TORCH_LIBRARY_DIRS}" INSTALL_RPATH "$ORIGIN")
  # torch's headers as system headers: their warnings are not ours
  target_include_directories(${target} SYSTEM PRIVATE ${MAMBA3_TORCH_INCLUDE_DIRS}
                                                      ${MAMBA3_TORCH_PYTHON_INCLUDE})
  target_compile_definitions(${target} PRIVATE
    _GLIBCXX_USE_CXX11_ABI=${MAMBA3_TORCH_CXX11_ABI} TORCH_EXTENSION_NAME=_C
    MAMBA3_TORCH_VERSION_STRING="${MAMBA3_TORCH_VERSION}"
    ${MAMBA3_TORCH_PYBIND_DEFS})
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  set(libs)
  # Looked up by hand rather than with find_library, whose cache would outlive a change of torch.
  foreach(name c10 torch torch_cpu torch_python)
    set(found)
    foreach(dir ${MAMBA3_TORCH_LIBRARY_DIRS})
      if(NOT found AND EXISTS "${dir}/lib${name}.so")
        set(found "${dir}/lib${name}.so")
      endif()
    endforeach()
    if(NOT found)
      message(FATAL_ERROR "lib${name}.so not found in ${MAMBA3_TORCH_LIBRARY_DIRS}")
    endif()
    list(APPEND libs "${found}")
  endforeach()
  target_link_libraries(${target} PRIVATE ${mamba3_target} ${libs})
endfunction()
