# shellcheck shell=bash
# The environment the bundle's programs run in (tools/gpu/README.md), in one place so that the runner (run.sh, on
# the GPU machine) and the minimal-root check (check_minimal_root.sh, here) start them alike. bundle.sh packs it
# beside run.sh. Source it, then call:
#
#   kit_relocate KIT   the unpacked bundle KIT's libraries first, and Open MPI (launcher, daemon, components, help
#                      files, PMIx) found there rather than at this build machine's paths
#   kit_mpi_env        a node-local Open MPI run: shared memory between the ranks of one host, no network
#                      transport, singletons without a daemon, root allowed (device machines run as root)

kit_relocate() {
  local kit="$1"
  export LD_LIBRARY_PATH="$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX="$kit/openmpi" OPAL_BINDIR="$kit/bin" OPAL_LIBDIR="$kit/lib"
  export OPAL_PKGLIBDIR="$kit/openmpi/lib/openmpi3" OPAL_PKGDATADIR="$kit/openmpi/share/openmpi"
  export OPAL_DATADIR="$kit/openmpi/share" OPAL_SYSCONFDIR="$kit/openmpi/etc"
  # PMIx 4 reads PMIX_PREFIX and its siblings (not PMIX_INSTALL_PREFIX): its components (zlib compression) and
  # help files; its configuration folder too, so that a PMIx installed on the machine does not redirect them.
  export PMIX_PREFIX="$kit/openmpi/pmix" PMIX_PKGLIBDIR="$kit/openmpi/pmix/lib/pmix"
  export PMIX_PKGDATADIR="$kit/openmpi/pmix/share/pmix" PMIX_SYSCONFDIR="$kit/openmpi/pmix/etc"
  export PMIX_MCA_mca_base_component_show_load_errors=0
}

kit_mpi_env() {
  # mpirun starts the ranks of this host itself (plm isolated): its default launcher (rsh) looks for ssh or rsh
  # first, even for local ranks, and ends the job when a bare machine has neither.
  export OMPI_MCA_plm=isolated OMPI_MCA_ess_singleton_isolated=1
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_osc=sm,pt2pt
  export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_mca_base_component_show_load_errors=0
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}
